// Jinja2 subset for chat templates; see modalities/core/data/jinja.h for scope and why it is
// hand-written. Structure: the template source is cut into text and tags with Jinja's whitespace
// rules (lex_template), tag contents are tokenized (Lexer) and parsed into statement and
// expression trees (Parser), which render against a scope stack (Renderer).
#include <modalities/core/data/jinja.h>

#include <modalities/sdk/error.h>
#include <modalities/sdk/formats/jsonl.h>
#include <modalities/sdk/utf8.h>

#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

namespace modalities::core::data::jinja {
namespace {

// Bounds of what a template may do (jinja2's sandbox refuses ranges beyond 100000 items; the others
// keep a hostile template from exhausting memory or the stack).
constexpr std::int64_t kMaxRange = 100'000;
constexpr std::uint64_t kMaxRepeatBytes = 100'000'000;

[[noreturn]] void fail(int line, const std::string& what) {
  throw Error(fmt::format("template line {}: {}", line, what));
}

// ---------------------------------------------------------------------------------------------
// Python str()/repr() and json.dumps of values
// ---------------------------------------------------------------------------------------------

// float.__repr__: the shortest text that reads back to the same double; fixed notation for
// decimal exponents in [-4, 16), otherwise d.ddde±XX; always with a '.' or an exponent.
std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // fmt's "{}" is the shortest round trip too, but switches to exponent notation at other
  // thresholds: decompose it into sign, digits and decimal exponent and lay it out as Python does.
  const std::string s = fmt::format("{}", d);
  std::string digits;
  int exp10 = 0;
  bool neg = false;
  std::size_t p = 0;
  if (s[p] == '-') {
    neg = true;
    ++p;
  }
  std::string mant;
  int e = 0;
  const std::size_t epos = s.find_first_of("eE");
  const std::string body = s.substr(p, epos == std::string::npos ? std::string::npos : epos - p);
  if (epos != std::string::npos) e = std::stoi(s.substr(epos + 1));
  const std::size_t dot = body.find('.');
  std::string intpart = dot == std::string::npos ? body : body.substr(0, dot);
  std::string frac = dot == std::string::npos ? "" : body.substr(dot + 1);
  mant = intpart + frac;
  int point = static_cast<int>(intpart.size()) + e;  // decimal point position after `point` digits of mant
  // strip leading zeros of mant
  std::size_t lz = 0;
  while (lz + 1 < mant.size() && mant[lz] == '0') {
    ++lz;
    --point;
  }
  mant = mant.substr(lz);
  while (mant.size() > 1 && mant.back() == '0') mant.pop_back();
  if (mant == "0") return neg ? "-0.0" : "0.0";
  digits = mant;
  exp10 = point - 1;  // scientific exponent
  std::string out = neg ? "-" : "";
  if (exp10 >= -4 && exp10 < 16) {
    if (point <= 0) {
      out += "0." + std::string(static_cast<std::size_t>(-point), '0') + digits;
    } else if (static_cast<std::size_t>(point) >= digits.size()) {
      out += digits + std::string(static_cast<std::size_t>(point) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<std::size_t>(point)) + "." + digits.substr(static_cast<std::size_t>(point));
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp10 < 0 ? '-' : '+', std::abs(exp10));
  }
  return out;
}

// Python's json.dumps(ensure_ascii=False) escapes strings exactly as the SDK's json_quote does.
void json_string(std::string& out, std::string_view s) { out += formats::json_quote(s); }

void dumps(std::string& out, const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: out += "null"; break;
    case Value::Kind::kBool: out += v.b ? "true" : "false"; break;
    case Value::Kind::kInt: out += std::to_string(v.i); break;
    case Value::Kind::kFloat:
      if (std::isnan(v.f)) out += "NaN";
      else if (std::isinf(v.f)) out += v.f > 0 ? "Infinity" : "-Infinity";
      else out += float_repr(v.f);
      break;
    case Value::Kind::kString: json_string(out, v.s); break;
    case Value::Kind::kList: {
      out += '[';
      for (std::size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += ", ";
        dumps(out, (*v.list)[i]);
      }
      out += ']';
      break;
    }
    case Value::Kind::kDict:
    case Value::Kind::kNamespace: {
      out += '{';
      bool first = true;
      for (const auto& [k, x] : *v.dict) {
        if (!first) out += ", ";
        first = false;
        json_string(out, k);
        out += ": ";
        dumps(out, x);
      }
      out += '}';
      break;
    }
  }
}

std::string py_repr(const Value& v);

std::string py_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.b ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.i);
    case Value::Kind::kFloat: return float_repr(v.f);
    case Value::Kind::kString: return v.s;
    default: return py_repr(v);
  }
}

// Code points Python's repr() escapes because str.isprintable() is false for them: controls, the
// non-ASCII spaces (Zs), line/paragraph separators, the common format characters (Cf) and private
// use. (Unassigned and rarer Cf code points are printed as they are.)
bool py_unprintable(char32_t c) {
  return c < 0x20 || (c >= 0x7F && c <= 0xA0) || c == 0xAD || c == 0x1680 || (c >= 0x2000 && c <= 0x200F) ||
         (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x2064) || (c >= 0x2066 && c <= 0x206F) || c == 0x3000 ||
         c == 0xFEFF || (c >= 0xE000 && c <= 0xF8FF) || (c >= 0xFFF9 && c <= 0xFFFB) || c >= 0xF0000;
}

std::string str_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t start = i;
    const char ch = s[i];
    const char32_t c = next_utf8(s, i);
    const std::size_t n = i - start;
    const std::string_view piece(s.data() + start, n);
    if (n == 1 && (ch == q || ch == '\\')) out += std::string("\\") + ch;
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (py_unprintable(c))
      out += c < 0x100     ? fmt::format("\\x{:02x}", static_cast<std::uint32_t>(c))
             : c < 0x10000 ? fmt::format("\\u{:04x}", static_cast<std::uint32_t>(c))
                           : fmt::format("\\U{:08x}", static_cast<std::uint32_t>(c));
    else out += piece;
  }
  return out + q;
}

std::string py_repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString: return str_repr(v.s);
    case Value::Kind::kList: {
      std::string s = v.tuple ? "(" : "[";
      for (std::size_t i = 0; i < v.list->size(); ++i) s += (i ? ", " : "") + py_repr((*v.list)[i]);
      if (v.tuple && v.list->size() == 1) s += ",";
      return s + (v.tuple ? ")" : "]");
    }
    case Value::Kind::kDict: {
      std::string s = "{";
      bool first = true;
      for (const auto& [k, x] : *v.dict) {
        s += (first ? "" : ", ") + str_repr(k) + ": " + py_repr(x);
        first = false;
      }
      return s + "}";
    }
    case Value::Kind::kNamespace: return "<Namespace>";
    case Value::Kind::kUndefined: return "Undefined";
    default: return py_str(v);
  }
}

// A value as an error message shows it: Python's repr, but of at most the first 80 bytes of a
// string and the first 10 items of a list (an operand can be a string of 100 MB, whose whole repr
// took minutes; the message needs only its start).
std::string error_repr(const Value& v) {
  constexpr std::size_t kBytes = 80, kItems = 10;
  if (v.kind == Value::Kind::kString && v.s.size() > kBytes) {
    std::size_t cut = kBytes;
    while (cut > 0 && (static_cast<unsigned char>(v.s[cut]) & 0xC0u) == 0x80u) --cut;  // a whole character
    return fmt::format("{}... ({} bytes)", str_repr(v.s.substr(0, cut)), v.s.size());
  }
  if (v.kind == Value::Kind::kList && v.list->size() > kItems) {
    std::string s = v.tuple ? "(" : "[";
    for (std::size_t i = 0; i < kItems; ++i) s += (i ? ", " : "") + error_repr((*v.list)[i]);
    return s + fmt::format(", ... ({} items){}", v.list->size(), v.tuple ? ")" : "]");
  }
  if (v.kind == Value::Kind::kList) {
    std::string s = v.tuple ? "(" : "[";
    for (std::size_t i = 0; i < v.list->size(); ++i) s += (i ? ", " : "") + error_repr((*v.list)[i]);
    if (v.tuple && v.list->size() == 1) s += ",";
    return s + (v.tuple ? ")" : "]");
  }
  return py_repr(v);
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.b;
    case Value::Kind::kInt: return v.i != 0;
    case Value::Kind::kFloat: return v.f != 0;
    case Value::Kind::kString: return !v.s.empty();
    case Value::Kind::kList: return !v.list->empty();
    default: return !v.dict->empty();
  }
}

bool is_number(const Value& v) {
  return v.kind == Value::Kind::kInt || v.kind == Value::Kind::kFloat || v.kind == Value::Kind::kBool;
}
double as_double(const Value& v) {
  return v.kind == Value::Kind::kFloat  ? v.f
         : v.kind == Value::Kind::kBool ? (v.b ? 1.0 : 0.0)
                                        : static_cast<double>(v.i);
}
std::int64_t as_int(const Value& v) { return v.kind == Value::Kind::kBool ? (v.b ? 1 : 0) : v.i; }

bool equal(const Value& a, const Value& b) {
  if (is_number(a) && is_number(b)) {
    if (a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat) return as_double(a) == as_double(b);
    return as_int(a) == as_int(b);
  }
  if ((a.kind == Value::Kind::kNone || a.kind == Value::Kind::kUndefined) &&
      (b.kind == Value::Kind::kNone || b.kind == Value::Kind::kUndefined))
    return a.kind == b.kind;
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kString: return a.s == b.s;
    case Value::Kind::kList:
      if (a.list->size() != b.list->size()) return false;
      for (std::size_t i = 0; i < a.list->size(); ++i)
        if (!equal((*a.list)[i], (*b.list)[i])) return false;
      return true;
    case Value::Kind::kDict: {
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, x] : *a.dict) {
        const Value* y = b.find(k);
        if (y == nullptr || !equal(x, *y)) return false;
      }
      return true;
    }
    default: return a.dict == b.dict;
  }
}

// ---------------------------------------------------------------------------------------------
// Expression tokens
// ---------------------------------------------------------------------------------------------

struct Token {
  enum Type { kName, kString, kInt, kFloat, kOp, kEnd } type = kEnd;
  std::string text;
  std::int64_t i = 0;
  double f = 0;
};

std::vector<Token> tokenize(std::string_view s, int line) {
  std::vector<Token> out;
  std::size_t i = 0;
  static const char* ops3[] = {"**", "//", "==", "!=", "<=", ">="};
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
      continue;
    }
    Token t;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t j = i;
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      t.type = Token::kName;
      t.text = std::string(s.substr(i, j - i));
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      std::size_t j = i;
      while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      bool is_float = false;
      if (j + 1 < s.size() && s[j] == '.' && std::isdigit(static_cast<unsigned char>(s[j + 1]))) {
        is_float = true;
        ++j;
        while (j < s.size() && (std::isdigit(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
      }
      if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
        std::size_t k = j + 1;
        if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
        if (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) {
          is_float = true;
          j = k;
          while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
        }
      }
      std::string text(s.substr(i, j - i));
      text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
      if (is_float) {
        t.type = Token::kFloat;
        t.f = std::strtod(text.c_str(), nullptr);  // Python's float(): 1e999 is inf
      } else {
        t.type = Token::kInt;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), t.i);
        if (ec != std::errc() || end != text.data() + text.size())
          fail(line, fmt::format("the integer literal {} does not fit 64 bits (Python's integers are unbounded; "
                                 "templates here use 64-bit integers)",
                                 text));
      }
      i = j;
    } else if (c == '\'' || c == '"') {
      std::string v;
      std::size_t j = i + 1;
      for (;; ++j) {
        if (j >= s.size()) fail(line, "unterminated string literal");
        if (s[j] == c) break;
        if (s[j] == '\\' && j + 1 < s.size()) {
          const char e = s[++j];
          switch (e) {
            case 'n': v += '\n'; break;
            case 't': v += '\t'; break;
            case 'r': v += '\r'; break;
            case '\\': v += '\\'; break;
            case '\'': v += '\''; break;
            case '"': v += '"'; break;
            case '0': v += '\0'; break;
            case 'x':
            case 'u':
            case 'U': {
              const std::size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
              // Python's rules: exactly n hex digits, a code point up to U+10FFFF; a lone
              // surrogate could not be written as UTF-8.
              if (j + n >= s.size()) fail(line, fmt::format("truncated \\{} escape in a string literal", e));
              char32_t cp = 0;
              for (std::size_t k = 1; k <= n; ++k) {
                const char h = s[j + k];
                const int d = h >= '0' && h <= '9'   ? h - '0'
                              : h >= 'a' && h <= 'f' ? h - 'a' + 10
                              : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                     : -1;
                if (d < 0) fail(line, fmt::format("truncated \\{} escape in a string literal", e));
                cp = cp * 16 + static_cast<char32_t>(d);
              }
              if (cp > 0x10FFFF) fail(line, "illegal Unicode character in a string literal");
              if (cp >= 0xD800 && cp <= 0xDFFF)
                fail(line, "a surrogate escape in a string literal cannot be written as UTF-8");
              j += n;
              append_utf8(v, cp);
              break;
            }
            default: v += '\\'; v += e;
          }
        } else {
          v += s[j];
        }
      }
      t.type = Token::kString;
      t.text = std::move(v);
      i = j + 1;
    } else {
      t.type = Token::kOp;
      bool two = false;
      for (const char* op : ops3)
        if (s.substr(i, 2) == op) {
          t.text = op;
          two = true;
        }
      if (!two) {
        if (std::string_view("+-*/%~()[]{},.:|=<>").find(c) == std::string_view::npos)
          fail(line, fmt::format("unexpected character '{}'", c));
        t.text = std::string(1, c);
      }
      i += t.text.size();
    }
    out.push_back(std::move(t));
  }
  out.push_back(Token{});
  return out;
}

// ---------------------------------------------------------------------------------------------
// Trees
// ---------------------------------------------------------------------------------------------

class Renderer;

struct Expr {
  int line = 0;
  virtual ~Expr() = default;
  virtual Value eval(Renderer& r) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Node {
  int line = 0;
  virtual ~Node() = default;
  virtual void render(Renderer& r, std::string& out) const = 0;
};
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

class Renderer {
 public:
  explicit Renderer(const Dict& globals) {
    scopes_.emplace_back();
    for (const auto& [k, v] : globals) scopes_.back()[k] = v;
  }
  Value lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it)
      if (auto f = it->find(name); f != it->end()) return f->second;
    return Value{};
  }
  void assign(const std::string& name, Value v) { scopes_.back()[name] = std::move(v); }
  void push() { scopes_.emplace_back(); }
  void pop() { scopes_.pop_back(); }

 private:
  std::vector<std::unordered_map<std::string, Value>> scopes_;
};

void render_body(const Body& body, Renderer& r, std::string& out) {
  for (const auto& n : body) n->render(r, out);
}

// --- expressions ---

struct Literal : Expr {
  Value v;
  Value eval(Renderer&) const override { return v; }
};

struct Name : Expr {
  std::string name;
  Value eval(Renderer& r) const override { return r.lookup(name); }
};

struct ListExpr : Expr {
  std::vector<ExprPtr> items;
  bool tuple = false;
  Value eval(Renderer& r) const override {
    List l;
    for (const auto& e : items) l.push_back(e->eval(r));
    Value v = Value::make_list(std::move(l));
    v.tuple = tuple;
    return v;
  }
};

struct DictExpr : Expr {
  std::vector<std::pair<ExprPtr, ExprPtr>> items;
  Value eval(Renderer& r) const override {
    Value d = Value::make_dict();
    for (const auto& [k, v] : items) {
      const Value key = k->eval(r);
      if (key.kind != Value::Kind::kString) fail(line, "dict keys must be strings here");
      d.set(key.s, v->eval(r));
    }
    return d;
  }
};

// Python strings index by code point: the UTF-8 pieces of `s`.
std::vector<std::string_view> code_points(std::string_view s) {
  std::vector<std::string_view> out;
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    n = std::min(n, s.size() - i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

char32_t decode_piece(std::string_view p) {
  const auto b = [&](std::size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(p[i])); };
  if (p.size() == 1) return b(0);
  if (p.size() == 2) return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
  if (p.size() == 3) return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
  return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
}

// Python's str.isspace() (what str.strip() and str.split() use).
bool py_isspace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// str.strip/lstrip/rstrip: whitespace, or the code points of `chars`.
std::string py_strip(const std::string& s, const std::optional<std::string>& chars, bool left, bool right) {
  const auto cps = code_points(s);
  std::vector<char32_t> set;
  if (chars)
    for (auto p : code_points(*chars)) set.push_back(decode_piece(p));
  const auto strip_it = [&](std::string_view p) {
    const char32_t c = decode_piece(p);
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c);
  };
  std::size_t a = 0, b = cps.size();
  while (left && a < b && strip_it(cps[a])) ++a;
  while (right && b > a && strip_it(cps[b - 1])) --b;
  std::string out;
  for (std::size_t i = a; i < b; ++i) out += cps[i];
  return out;
}

Value get_attr(const Value& obj, const std::string& name, int line) {
  if (obj.kind == Value::Kind::kUndefined)
    fail(line, fmt::format("'{}' is undefined: cannot read its '{}'", "value", name));
  if (obj.kind == Value::Kind::kDict || obj.kind == Value::Kind::kNamespace) {
    if (const Value* v = obj.find(name)) return *v;
  }
  return Value{};  // undefined; methods are resolved by Call
}

Value get_item(const Value& obj, const Value& key, int line) {
  if (obj.kind == Value::Kind::kUndefined) fail(line, "cannot index an undefined value");
  if (obj.kind == Value::Kind::kDict && key.kind == Value::Kind::kString) {
    if (const Value* v = obj.find(key.s)) return *v;
    return Value{};
  }
  if ((obj.kind == Value::Kind::kList || obj.kind == Value::Kind::kString) && key.kind == Value::Kind::kInt) {
    const std::vector<std::string_view> cps =
        obj.kind == Value::Kind::kString ? code_points(obj.s) : std::vector<std::string_view>{};
    const auto n = static_cast<std::int64_t>(obj.kind == Value::Kind::kList ? obj.list->size() : cps.size());
    std::int64_t i = key.i < 0 ? key.i + n : key.i;
    if (i < 0 || i >= n) return Value{};
    if (obj.kind == Value::Kind::kList) return (*obj.list)[static_cast<std::size_t>(i)];
    return Value::string(std::string(cps[static_cast<std::size_t>(i)]));
  }
  return Value{};
}

struct Attr : Expr {
  ExprPtr obj;
  std::string name;
  Value eval(Renderer& r) const override {
    const Value o = obj->eval(r);
    if (o.kind == Value::Kind::kUndefined) {
      const auto* n = dynamic_cast<const Name*>(obj.get());
      fail(line, fmt::format("'{}' is undefined (reading its '{}')", n ? n->name : "value", name));
    }
    return get_attr(o, name, line);
  }
};

struct Item : Expr {
  ExprPtr obj, key;
  Value eval(Renderer& r) const override { return get_item(obj->eval(r), key->eval(r), line); }
};

struct Slice : Expr {
  ExprPtr obj, start, stop, step;
  Value eval(Renderer& r) const override {
    const Value o = obj->eval(r);
    const bool is_list = o.kind == Value::Kind::kList;
    if (!is_list && o.kind != Value::Kind::kString) fail(line, "only lists and strings can be sliced");
    const std::vector<std::string_view> cps = is_list ? std::vector<std::string_view>{} : code_points(o.s);
    const auto n = static_cast<std::int64_t>(is_list ? o.list->size() : cps.size());
    const std::int64_t st = step ? step->eval(r).i : 1;
    if (st == 0) fail(line, "slice step cannot be zero");
    const auto norm = [&](const ExprPtr& e, std::int64_t dflt) {
      if (!e) return dflt;
      std::int64_t v = e->eval(r).i;
      if (v < 0) v += n;
      return st > 0 ? std::clamp<std::int64_t>(v, 0, n) : std::clamp<std::int64_t>(v, -1, n - 1);
    };
    const std::int64_t a = norm(start, st > 0 ? 0 : n - 1), b = norm(stop, st > 0 ? n : -1);
    List l;
    std::string s;
    for (std::int64_t i = a; st > 0 ? i < b : i > b; i += st) {
      if (is_list) l.push_back((*o.list)[static_cast<std::size_t>(i)]);
      else s += cps[static_cast<std::size_t>(i)];
    }
    return is_list ? Value::make_list(std::move(l)) : Value::string(std::move(s));
  }
};

struct Unary : Expr {
  std::string op;
  ExprPtr x;
  Value eval(Renderer& r) const override {
    const Value v = x->eval(r);
    if (op == "not") return Value::boolean(!truthy(v));
    if (!is_number(v)) fail(line, fmt::format("bad operand for unary {}", op));
    if (op == "+") return v;
    return v.kind == Value::Kind::kFloat ? Value::real(-v.f) : Value::integer(-as_int(v));
  }
};

bool contains(const Value& container, const Value& x, int line) {
  switch (container.kind) {
    case Value::Kind::kString:
      if (x.kind != Value::Kind::kString) fail(line, "'in <string>' requires a string");
      return container.s.find(x.s) != std::string::npos;
    case Value::Kind::kList:
      return std::any_of(container.list->begin(), container.list->end(), [&](const Value& y) { return equal(x, y); });
    case Value::Kind::kDict: return x.kind == Value::Kind::kString && container.find(x.s) != nullptr;
    default: fail(line, "'in' needs a string, list or dict");
  }
}

Value arith(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "~") return Value::string(py_str(a) + py_str(b));
  if (op == "+") {
    if (a.kind == Value::Kind::kString && b.kind == Value::Kind::kString) return Value::string(a.s + b.s);
    if (a.kind == Value::Kind::kList && b.kind == Value::Kind::kList) {
      // Python: list + list is a list, tuple + tuple a tuple; mixing them is a TypeError.
      if (a.tuple != b.tuple)
        fail(line, fmt::format("can only concatenate {} (not \"{}\") to {}", a.tuple ? "tuple" : "list",
                               b.tuple ? "tuple" : "list", a.tuple ? "tuple" : "list"));
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      Value v = Value::make_list(std::move(l));
      v.tuple = a.tuple;
      return v;
    }
  }
  if (op == "*" && a.kind == Value::Kind::kString && b.kind == Value::Kind::kInt) {
    if (b.i > 0 && a.s.size() > 0 && static_cast<std::uint64_t>(b.i) > kMaxRepeatBytes / a.s.size())
      fail(line,
           fmt::format("repeating a string of {} bytes {} times exceeds {} bytes", a.s.size(), b.i, kMaxRepeatBytes));
    std::string s;
    for (std::int64_t i = 0; i < b.i; ++i) s += a.s;
    return Value::string(s);
  }
  if (!is_number(a) || !is_number(b))
    fail(line, fmt::format("unsupported operands for {}: {} and {}", op, error_repr(a), error_repr(b)));
  // Python's arithmetic: division, floor division and modulo by zero and 0 ** -1 raise
  // ZeroDivisionError; integers are unbounded there, so a result beyond 64 bits is an error here
  // rather than a wrapped value.
  const bool fl = a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat;
  const bool by_zero = as_double(b) == 0.0;
  if ((op == "/" || op == "//" || op == "%") && by_zero)
    fail(line, fmt::format("division by zero ({} {} {})", error_repr(a), op, error_repr(b)));
  if (op == "**" && as_double(a) == 0.0 && as_double(b) < 0)
    fail(line, fmt::format("0 cannot be raised to the negative power {}", error_repr(b)));
  if (op == "/") return Value::real(as_double(a) / as_double(b));
  if (fl) {
    const double x = as_double(a), y = as_double(b);
    if (op == "+") return Value::real(x + y);
    if (op == "-") return Value::real(x - y);
    if (op == "*") return Value::real(x * y);
    if (op == "**") return Value::real(std::pow(x, y));
    if (op == "//") return Value::real(std::floor(x / y));
    if (op == "%") {
      const double m = std::fmod(x, y);
      return Value::real(m != 0 && ((m < 0) != (y < 0)) ? m + y : m);
    }
  }
  const std::int64_t x = as_int(a), y = as_int(b);
  const auto overflow = [&]() -> Value {
    fail(line, fmt::format("integer overflow: {} {} {} does not fit 64 bits (Python's integers are unbounded; "
                           "templates here use 64-bit integers)",
                           x, op, y));
  };
  std::int64_t r = 0;
  if (op == "+") return __builtin_add_overflow(x, y, &r) ? overflow() : Value::integer(r);
  if (op == "-") return __builtin_sub_overflow(x, y, &r) ? overflow() : Value::integer(r);
  if (op == "*") return __builtin_mul_overflow(x, y, &r) ? overflow() : Value::integer(r);
  if (op == "**") {
    if (y < 0) return Value::real(std::pow(static_cast<double>(x), static_cast<double>(y)));  // 2 ** -1 is 0.5
    std::int64_t result = 1, base = x;
    for (std::int64_t e = y; e > 0; e >>= 1) {
      if ((e & 1) && __builtin_mul_overflow(result, base, &result)) return overflow();
      if (e > 1 && __builtin_mul_overflow(base, base, &base)) return overflow();
    }
    return Value::integer(result);
  }
  if (x == INT64_MIN && y == -1) return op == "%" ? Value::integer(0) : overflow();
  std::int64_t q = x / y, m = x % y;
  if (m != 0 && ((m < 0) != (y < 0))) {  // floor, not truncation
    --q;
    m += y;
  }
  return Value::integer(op == "//" ? q : m);
}

bool less(const Value& a, const Value& b, int line) {
  if (is_number(a) && is_number(b)) return as_double(a) < as_double(b);
  if (a.kind == Value::Kind::kString && b.kind == Value::Kind::kString) return a.s < b.s;
  fail(line, fmt::format("cannot compare {} and {}", error_repr(a), error_repr(b)));
}

struct Binary : Expr {
  std::string op;
  ExprPtr a, b;
  Value eval(Renderer& r) const override {
    if (op == "and") {
      const Value x = a->eval(r);
      return truthy(x) ? b->eval(r) : x;
    }
    if (op == "or") {
      const Value x = a->eval(r);
      return truthy(x) ? x : b->eval(r);
    }
    const Value x = a->eval(r), y = b->eval(r);
    if (op == "==") return Value::boolean(equal(x, y));
    if (op == "!=") return Value::boolean(!equal(x, y));
    if (op == "<") return Value::boolean(less(x, y, line));
    if (op == ">") return Value::boolean(less(y, x, line));
    if (op == "<=") return Value::boolean(!less(y, x, line));
    if (op == ">=") return Value::boolean(!less(x, y, line));
    if (op == "in") return Value::boolean(contains(y, x, line));
    if (op == "not in") return Value::boolean(!contains(y, x, line));
    return arith(op, x, y, line);
  }
};

struct CondExpr : Expr {
  ExprPtr then, cond, otherwise;
  Value eval(Renderer& r) const override {
    if (truthy(cond->eval(r))) return then->eval(r);
    return otherwise ? otherwise->eval(r) : Value{};
  }
};

struct Test : Expr {
  ExprPtr x;
  std::string name;
  std::vector<ExprPtr> args;
  bool negate = false;
  Value eval(Renderer& r) const override {
    const Value v = x->eval(r);
    bool res = false;
    if (name == "defined") res = v.kind != Value::Kind::kUndefined;
    else if (name == "undefined") res = v.kind == Value::Kind::kUndefined;
    else if (name == "none") res = v.kind == Value::Kind::kNone;
    else if (name == "string") res = v.kind == Value::Kind::kString;
    else if (name == "number") res = is_number(v);
    else if (name == "integer") res = v.kind == Value::Kind::kInt;
    else if (name == "float") res = v.kind == Value::Kind::kFloat;
    else if (name == "boolean") res = v.kind == Value::Kind::kBool;
    else if (name == "true") res = v.kind == Value::Kind::kBool && v.b;
    else if (name == "false") res = v.kind == Value::Kind::kBool && !v.b;
    else if (name == "mapping") res = v.kind == Value::Kind::kDict;
    else if (name == "sequence" || name == "iterable")
      res = v.kind == Value::Kind::kList || v.kind == Value::Kind::kString || v.kind == Value::Kind::kDict;
    else if (name == "even" || name == "odd") res = v.kind == Value::Kind::kInt && ((v.i % 2 == 0) == (name == "even"));
    else if (name == "eq" || name == "equalto" || name == "==") res = equal(v, args.at(0)->eval(r));
    else if (name == "ne" || name == "!=") res = !equal(v, args.at(0)->eval(r));
    else fail(line, fmt::format("unknown test '{}'", name));
    return Value::boolean(res != negate);
  }
};

Value to_list(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::kList: return v;
    case Value::Kind::kString: {
      List l;
      // Characters: UTF-8 sequences stay together (Python iterates code points).
      for (std::size_t i = 0; i < v.s.size();) {
        std::size_t n = 1;
        const auto c = static_cast<unsigned char>(v.s[i]);
        if (c >= 0xF0) n = 4;
        else if (c >= 0xE0) n = 3;
        else if (c >= 0xC0) n = 2;
        l.push_back(Value::string(v.s.substr(i, n)));
        i += n;
      }
      return Value::make_list(std::move(l));
    }
    case Value::Kind::kDict: {
      List l;
      for (const auto& [k, x] : *v.dict) l.push_back(Value::string(k));
      return Value::make_list(std::move(l));
    }
    case Value::Kind::kUndefined: return Value::make_list();
    default: fail(line, fmt::format("{} is not iterable", error_repr(v)));
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string title(std::string s) {
  bool start = true;
  for (char& c : s) {
    const bool alpha = std::isalpha(static_cast<unsigned char>(c)) != 0;
    c = static_cast<char>(
        alpha ? (start ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)))
              : c);
    start = !alpha;
  }
  return s;
}
std::string replace_all(std::string s, const std::string& from, const std::string& to, std::int64_t count = -1) {
  if (from.empty()) {  // Python: 'ab'.replace('', '-') is '-a-b-' (between code points, at most `count`)
    std::string out;
    std::int64_t n = 0;
    std::size_t i = 0;
    while (true) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (i >= s.size()) break;
      std::size_t len = 1;  // one UTF-8 code point
      while (i + len < s.size() && (static_cast<unsigned char>(s[i + len]) & 0xC0) == 0x80) ++len;
      out.append(s, i, len);
      i += len;
    }
    return out;
  }
  std::size_t pos = 0;
  for (std::int64_t n = 0; (count < 0 || n < count) && (pos = s.find(from, pos)) != std::string::npos; ++n) {
    s.replace(pos, from.size(), to);
    pos += to.size();
  }
  return s;
}

struct Call;

// Arguments as evaluated: positional and keyword.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(std::size_t i, const std::string& name) const {
    if (i < pos.size()) return &pos[i];
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
    return nullptr;
  }
};

Value apply_filter(const std::string& name, const Value& v, const Args& a, int line) {
  const auto str_arg = [&](std::size_t i, const std::string& k, const std::string& dflt) {
    const Value* x = a.get(i, k);
    return x ? py_str(*x) : dflt;
  };
  if (name == "trim") {
    const Value* chars = a.get(0, "chars");
    return Value::string(
        py_strip(py_str(v), chars && chars->kind != Value::Kind::kNone ? std::optional(py_str(*chars)) : std::nullopt,
                 true, true));
  }
  if (name == "length" || name == "count") {
    if (v.kind == Value::Kind::kString) {
      std::int64_t n = 0;
      for (const char c : v.s) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
      return Value::integer(n);
    }
    if (v.kind == Value::Kind::kList) return Value::integer(static_cast<std::int64_t>(v.list->size()));
    if (v.kind == Value::Kind::kDict) return Value::integer(static_cast<std::int64_t>(v.dict->size()));
    if (v.kind == Value::Kind::kUndefined) return Value::integer(0);
    fail(line, "length of a value without one");
  }
  if (name == "tojson") {
    if (!a.pos.empty() || !a.kw.empty())
      fail(line, "tojson with arguments (ensure_ascii, indent, separators, sort_keys) is not supported");
    return Value::string(json_dumps(v));
  }
  if (name == "upper") return Value::string(upper(py_str(v)));
  if (name == "lower") return Value::string(lower(py_str(v)));
  if (name == "title") return Value::string(title(py_str(v)));
  if (name == "capitalize") {
    std::string s = lower(py_str(v));
    if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
    return Value::string(s);
  }
  if (name == "string") return Value::string(py_str(v));
  // int(x) / float(x) on the whole (stripped) text, else the default 0, as jinja2's filters.
  const auto parse_number = [&](bool integer) -> std::optional<double> {
    const std::string t = py_strip(py_str(v), std::nullopt, true, true);
    // Python's int()/float() read decimal text only (strtod would read "0x1A" as 26).
    if (t.empty() || t.find_first_of("xXpP") != std::string::npos) return std::nullopt;
    try {
      std::size_t used = 0;
      const double d = integer ? static_cast<double>(std::stoll(t, &used)) : std::stod(t, &used);
      if (used == t.size()) return d;
    } catch (const std::exception&) {
    }
    return std::nullopt;
  };
  if (name == "int") {
    if (v.kind == Value::Kind::kFloat) return Value::integer(static_cast<std::int64_t>(v.f));
    if (is_number(v)) return Value::integer(as_int(v));
    if (auto d = parse_number(true)) return Value::integer(static_cast<std::int64_t>(*d));
    if (auto d = parse_number(false)) return Value::integer(static_cast<std::int64_t>(*d));
    return Value::integer(0);
  }
  if (name == "float") {
    if (is_number(v)) return Value::real(as_double(v));
    return Value::real(parse_number(false).value_or(0.0));
  }
  if (name == "abs")
    return v.kind == Value::Kind::kFloat ? Value::real(std::fabs(v.f)) : Value::integer(std::llabs(as_int(v)));
  if (name == "round") {
    // Python's round(x, n): the exact binary value rounded half-to-even in decimal, as "%.nf" does.
    const std::int64_t prec = a.get(0, "precision") ? as_int(*a.get(0, "precision")) : 0;
    if (prec < 0 || prec > 17) fail(line, "round precision must be in 0..17 here");
    if (const Value* m = a.get(1, "method"); m && py_str(*m) != "common")
      fail(line, "round(method='floor'/'ceil') is not supported");
    return Value::real(std::stod(fmt::format("{:.{}f}", as_double(v), prec)));
  }
  if (name == "default" || name == "d") {
    const Value* dflt = a.get(0, "default_value");
    const bool boolean = a.get(1, "boolean") && truthy(*a.get(1, "boolean"));
    const bool use = v.kind == Value::Kind::kUndefined || (boolean && !truthy(v));
    return use ? (dflt ? *dflt : Value::string("")) : v;
  }
  if (name == "replace") {
    const Value* cnt = a.get(2, "count");
    return Value::string(replace_all(py_str(v), str_arg(0, "old", ""), str_arg(1, "new", ""), cnt ? as_int(*cnt) : -1));
  }
  if (name == "indent") {
    const std::int64_t width = a.get(0, "width") ? as_int(*a.get(0, "width")) : 4;
    const bool first = a.get(1, "first") && truthy(*a.get(1, "first"));
    if (width > 1'000'000) fail(line, fmt::format("indent width {} is too large", width));
    const std::string pad(static_cast<std::size_t>(std::max<std::int64_t>(width, 0)), ' ');
    std::string s = py_str(v), out;
    std::size_t start = 0;
    bool is_first = true;
    while (start <= s.size()) {
      const std::size_t nl = s.find('\n', start);
      const std::string ln = s.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
      out += ((is_first && !first) || ln.empty() ? "" : pad) + ln;
      if (nl == std::string::npos) break;
      out += '\n';
      start = nl + 1;
      is_first = false;
    }
    return Value::string(out);
  }
  const Value l = to_list(v, line);
  if (name == "list") return l;
  if (name == "first") return l.list->empty() ? Value{} : l.list->front();
  if (name == "last") return l.list->empty() ? Value{} : l.list->back();
  if (name == "reverse") {
    if (v.kind == Value::Kind::kString) {
      const auto cps = code_points(v.s);
      std::string s;
      for (auto it = cps.rbegin(); it != cps.rend(); ++it) s += *it;
      return Value::string(s);
    }
    List x(l.list->rbegin(), l.list->rend());
    return Value::make_list(std::move(x));
  }
  if (name == "join") {
    const std::string sep = str_arg(0, "d", "");
    const Value* attr = a.get(1, "attribute");
    std::string s;
    for (std::size_t i = 0; i < l.list->size(); ++i) {
      const Value& x = (*l.list)[i];
      s += (i ? sep : "") + py_str(attr ? get_attr(x, py_str(*attr), line) : x);
    }
    return Value::string(s);
  }
  if (name == "items") {
    if (v.kind != Value::Kind::kDict) fail(line, "items needs a dict");
    List x;
    for (const auto& [k, y] : *v.dict) {
      Value pair = Value::make_list({Value::string(k), y});
      pair.tuple = true;
      x.push_back(std::move(pair));
    }
    return Value::make_list(std::move(x));
  }
  // jinja2 compares strings case-insensitively here unless case_sensitive=true.
  const bool case_sensitive = a.get(99, "case_sensitive") && truthy(*a.get(99, "case_sensitive"));
  const auto fold = [&](const Value& x) {
    return !case_sensitive && x.kind == Value::Kind::kString ? Value::string(lower(x.s)) : x;
  };
  if (name == "unique") {
    List x;
    for (const Value& y : *l.list)
      if (std::none_of(x.begin(), x.end(), [&](const Value& z) { return equal(fold(y), fold(z)); })) x.push_back(y);
    return Value::make_list(std::move(x));
  }
  if (name == "sort") {
    List x = *l.list;
    const bool rev = a.get(0, "reverse") && truthy(*a.get(0, "reverse"));
    const bool cs = a.get(1, "case_sensitive") && truthy(*a.get(1, "case_sensitive"));
    const Value* attr = a.get(2, "attribute");
    std::stable_sort(x.begin(), x.end(), [&](const Value& p, const Value& q) {
      Value pp = attr ? get_attr(p, py_str(*attr), line) : p, qq = attr ? get_attr(q, py_str(*attr), line) : q;
      if (!cs && pp.kind == Value::Kind::kString) pp = Value::string(lower(pp.s));
      if (!cs && qq.kind == Value::Kind::kString) qq = Value::string(lower(qq.s));
      return rev ? less(qq, pp, line) : less(pp, qq, line);
    });
    return Value::make_list(std::move(x));
  }
  if (name == "map") {
    const Value* attr = a.get(99, "attribute");
    List x;
    for (const Value& y : *l.list) {
      if (attr) x.push_back(get_attr(y, py_str(*attr), line));
      else if (!a.pos.empty()) x.push_back(apply_filter(py_str(a.pos[0]), y, Args{}, line));
      else fail(line, "map needs a filter name or attribute=");
    }
    return Value::make_list(std::move(x));
  }
  if (name == "selectattr" || name == "rejectattr") {
    if (a.pos.empty()) fail(line, name + " needs an attribute name");
    const std::string attr = py_str(a.pos[0]);
    List x;
    for (const Value& y : *l.list) {
      const Value field = get_attr(y, attr, line);
      bool ok;
      if (a.pos.size() == 1) {
        ok = truthy(field);
      } else {
        const std::string test = py_str(a.pos[1]);
        if ((test == "equalto" || test == "eq" || test == "==") && a.pos.size() > 2) ok = equal(field, a.pos[2]);
        else if ((test == "ne" || test == "!=") && a.pos.size() > 2) ok = !equal(field, a.pos[2]);
        else if (test == "defined") ok = field.kind != Value::Kind::kUndefined;
        else if (test == "undefined") ok = field.kind == Value::Kind::kUndefined;
        else if (test == "none") ok = field.kind == Value::Kind::kNone;
        else if (test == "string") ok = field.kind == Value::Kind::kString;
        else fail(line, fmt::format("{} with test '{}' is not supported", name, test));
      }
      if (ok == (name == "selectattr")) x.push_back(y);
    }
    return Value::make_list(std::move(x));
  }
  fail(line, fmt::format("unknown filter '{}'", name));
}

const std::set<std::string> kFilters = {
    "trim",    "length", "count", "tojson",  "upper", "lower",   "title",      "capitalize", "string", "int",
    "float",   "abs",    "round", "default", "d",     "replace", "indent",     "list",       "first",  "last",
    "reverse", "join",   "items", "unique",  "sort",  "map",     "selectattr", "rejectattr"};

struct ArgExprs {
  std::vector<ExprPtr> pos;
  std::vector<std::pair<std::string, ExprPtr>> kw;
  Args eval(Renderer& r) const {
    Args a;
    for (const auto& e : pos) a.pos.push_back(e->eval(r));
    for (const auto& [k, e] : kw) a.kw.emplace_back(k, e->eval(r));
    return a;
  }
};

struct Filter : Expr {
  ExprPtr x;
  std::string name;
  ArgExprs args;
  Value eval(Renderer& r) const override { return apply_filter(name, x->eval(r), args.eval(r), line); }
};

// Calls: raise_exception(msg), namespace(...), range(...), and methods of strings and dicts.
struct Call : Expr {
  ExprPtr fn;  // Name or Attr
  ArgExprs args;
  Value eval(Renderer& r) const override {
    const Args a = args.eval(r);
    if (const auto* n = dynamic_cast<const Name*>(fn.get())) {
      if (n->name == "raise_exception")
        fail(line, fmt::format("the chat template raised an exception: {}", a.pos.empty() ? "" : py_str(a.pos[0])));
      if (n->name == "namespace") {
        Value ns = Value::make_dict();
        ns.kind = Value::Kind::kNamespace;
        for (const auto& [k, v] : a.kw) ns.set(k, v);
        return ns;
      }
      if (n->name == "range") {
        std::int64_t start = 0, stop = 0, step = 1;
        if (a.pos.size() == 1) stop = as_int(a.pos[0]);
        else if (a.pos.size() >= 2) {
          start = as_int(a.pos[0]);
          stop = as_int(a.pos[1]);
          if (a.pos.size() > 2) step = as_int(a.pos[2]);
        }
        if (step == 0) fail(line, "range() step must not be zero");
        // jinja2's sandbox refuses ranges of more than 100000 items (MAX_RANGE); the count is
        // computed in 128 bits, so no step overflows.
        const __int128 span = step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
        const __int128 count = span <= 0 ? 0
                                         : (span + (step > 0 ? step : -static_cast<__int128>(step)) - 1) /
                                               (step > 0 ? step : -static_cast<__int128>(step));
        if (count > kMaxRange)
          fail(line, fmt::format("range() of {} items: more than {} (jinja2's sandbox limit)",
                                 static_cast<unsigned long long>(count), kMaxRange));
        List l;
        for (__int128 k = 0; k < count; ++k) l.push_back(Value::integer(static_cast<std::int64_t>(start + k * step)));
        return Value::make_list(std::move(l));
      }
      fail(line, fmt::format("'{}' is not a function here (raise_exception, namespace, range are)", n->name));
    }
    const auto* at = dynamic_cast<const Attr*>(fn.get());
    if (at == nullptr) fail(line, "only functions and methods can be called");
    const Value self = at->obj->eval(r);
    const std::string& m = at->name;
    const auto s_arg = [&](std::size_t i) { return i < a.pos.size() ? py_str(a.pos[i]) : std::string(); };
    if (self.kind == Value::Kind::kString) {
      const auto opt_chars = [&]() -> std::optional<std::string> {
        if (a.pos.empty() || a.pos[0].kind == Value::Kind::kNone) return std::nullopt;
        return py_str(a.pos[0]);
      };
      if (m == "strip") return Value::string(py_strip(self.s, opt_chars(), true, true));
      if (m == "lstrip") return Value::string(py_strip(self.s, opt_chars(), true, false));
      if (m == "rstrip") return Value::string(py_strip(self.s, opt_chars(), false, true));
      if (m == "upper") return Value::string(upper(self.s));
      if (m == "lower") return Value::string(lower(self.s));
      if (m == "title") return Value::string(title(self.s));
      if (m == "startswith" || m == "endswith") {
        std::vector<std::string> options;
        if (!a.pos.empty() && a.pos[0].kind == Value::Kind::kList)
          for (const Value& x : *a.pos[0].list) options.push_back(py_str(x));
        else options.push_back(s_arg(0));
        if (a.pos.size() > 1) fail(line, fmt::format("{}() with start/end positions is not supported", m));
        return Value::boolean(std::any_of(options.begin(), options.end(), [&](const std::string& o) {
          return m == "startswith" ? self.s.starts_with(o) : self.s.ends_with(o);
        }));
      }
      if (m == "replace") {
        const std::int64_t count = a.pos.size() > 2 ? as_int(a.pos[2]) : -1;
        return Value::string(replace_all(self.s, s_arg(0), s_arg(1), count));
      }
      if (m == "split") {
        const Value* sep_v = a.get(0, "sep");
        const Value* max_v = a.get(1, "maxsplit");
        std::int64_t maxsplit = max_v ? as_int(*max_v) : -1;
        List l;
        if (sep_v == nullptr || sep_v->kind == Value::Kind::kNone) {  // runs of whitespace
          const auto cps = code_points(self.s);
          std::size_t i = 0;
          while (true) {
            while (i < cps.size() && py_isspace(decode_piece(cps[i]))) ++i;
            if (i >= cps.size()) break;
            std::string word;
            if (maxsplit == 0) {
              for (; i < cps.size(); ++i) word += cps[i];  // the rest as is (Python keeps trailing space)
              l.push_back(Value::string(word));
              break;
            }
            for (; i < cps.size() && !py_isspace(decode_piece(cps[i])); ++i) word += cps[i];
            l.push_back(Value::string(word));
            if (maxsplit > 0) --maxsplit;
          }
        } else {
          const std::string sep = py_str(*sep_v);
          if (sep.empty()) fail(line, "empty separator");
          std::size_t i = 0;
          while (true) {
            const std::size_t j = maxsplit == 0 ? std::string::npos : self.s.find(sep, i);
            l.push_back(Value::string(self.s.substr(i, j == std::string::npos ? std::string::npos : j - i)));
            if (j == std::string::npos) break;
            i = j + sep.size();
            if (maxsplit > 0) --maxsplit;
          }
        }
        return Value::make_list(std::move(l));
      }
    }
    if (self.kind == Value::Kind::kDict) {
      if (m == "items") return apply_filter("items", self, Args{}, line);
      if (m == "keys") return to_list(self, line);
      if (m == "values") {
        List l;
        for (const auto& [k, v] : *self.dict) l.push_back(v);
        return Value::make_list(std::move(l));
      }
      if (m == "get") {
        const Value* v = self.find(s_arg(0));
        return v ? *v : (a.pos.size() > 1 ? a.pos[1] : Value::none());
      }
    }
    fail(line, fmt::format("method '{}' of {} is not supported", m, error_repr(self)));
  }
};

// --- statements ---

struct Text : Node {
  std::string text;
  void render(Renderer&, std::string& out) const override { out += text; }
};

struct Output : Node {
  ExprPtr e;
  void render(Renderer& r, std::string& out) const override { out += py_str(e->eval(r)); }
};

struct If : Node {
  std::vector<std::pair<ExprPtr, Body>> branches;  // condition nullptr: else
  void render(Renderer& r, std::string& out) const override {
    for (const auto& [cond, body] : branches)
      if (!cond || truthy(cond->eval(r))) {
        render_body(body, r, out);
        return;
      }
  }
};

struct For : Node {
  std::vector<std::string> targets;
  ExprPtr iter, filter;
  Body body, otherwise;
  void render(Renderer& r, std::string& out) const override {
    const Value seq = to_list(iter->eval(r), line);
    List items;
    for (const Value& v : *seq.list) {
      if (filter) {
        r.push();
        bind(r, v);
        const bool keep = truthy(filter->eval(r));
        r.pop();
        if (!keep) continue;
      }
      items.push_back(v);
    }
    if (items.empty()) {
      render_body(otherwise, r, out);
      return;
    }
    const auto n = static_cast<std::int64_t>(items.size());
    for (std::int64_t i = 0; i < n; ++i) {
      r.push();
      bind(r, items[static_cast<std::size_t>(i)]);
      Value loop = Value::make_dict();
      loop.set("index", Value::integer(i + 1));
      loop.set("index0", Value::integer(i));
      loop.set("revindex", Value::integer(n - i));
      loop.set("revindex0", Value::integer(n - i - 1));
      loop.set("first", Value::boolean(i == 0));
      loop.set("last", Value::boolean(i == n - 1));
      loop.set("length", Value::integer(n));
      loop.set("depth", Value::integer(1));  // recursive loops are not supported: always the top level
      loop.set("depth0", Value::integer(0));
      loop.set("previtem", i > 0 ? items[static_cast<std::size_t>(i - 1)] : Value{});
      loop.set("nextitem", i + 1 < n ? items[static_cast<std::size_t>(i + 1)] : Value{});
      r.assign("loop", loop);
      render_body(body, r, out);
      r.pop();
    }
  }
  void bind(Renderer& r, const Value& v) const {
    if (targets.size() == 1) {
      r.assign(targets[0], v);
      return;
    }
    const Value l = to_list(v, line);
    if (l.list->size() != targets.size())
      fail(line, fmt::format("cannot unpack {} values into {} names", l.list->size(), targets.size()));
    for (std::size_t i = 0; i < targets.size(); ++i) r.assign(targets[i], (*l.list)[i]);
  }
};

struct Set : Node {
  std::string name, attr;  // attr: {% set ns.attr = ... %}
  ExprPtr value;
  void render(Renderer& r, std::string&) const override {
    Value v = value->eval(r);
    if (attr.empty()) {
      r.assign(name, std::move(v));
      return;
    }
    Value ns = r.lookup(name);
    if (ns.kind != Value::Kind::kNamespace)
      fail(line, fmt::format("'{}' is not a namespace(): cannot set '{}'", name, attr));
    ns.set(attr, std::move(v));  // shared: the namespace object itself changes
  }
};

// ---------------------------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------------------------

class ExprParser {
 public:
  ExprParser(std::vector<Token> toks, int line) : t_(std::move(toks)), line_(line) {}

  ExprPtr expression() {
    const Nested nested(*this);
    ExprPtr e = or_expr();
    if (is_name("if")) {
      ++p_;
      auto c = make<CondExpr>();
      c->then = std::move(e);
      c->cond = or_expr();
      if (is_name("else")) {
        ++p_;
        c->otherwise = expression();
      }
      return c;
    }
    return e;
  }
  // Without the conditional form (the iterable of a for loop, which has its own `if`).
  ExprPtr or_only() { return or_expr(); }

  bool at_end() const { return t_[p_].type == Token::kEnd; }
  bool is_name(const char* n) const { return t_[p_].type == Token::kName && t_[p_].text == n; }
  bool is_op(const char* o) const { return t_[p_].type == Token::kOp && t_[p_].text == o; }
  std::string name() {
    if (t_[p_].type != Token::kName) fail(line_, fmt::format("expected a name, got '{}'", t_[p_].text));
    return t_[p_++].text;
  }
  void expect_op(const char* o) {
    if (!is_op(o))
      fail(line_, fmt::format("expected '{}', got '{}'", o, t_[p_].type == Token::kEnd ? "end" : t_[p_].text));
    ++p_;
  }
  void expect_end() {
    if (!at_end()) fail(line_, fmt::format("unexpected '{}'", t_[p_].text));
  }
  void skip() { ++p_; }

 private:
  // Note [Expression depth]: a tree deeper than kMaxExprDepth is refused while parsing: 30,000
  // nested parentheses, or 100,000 chained `not`, `.a` or `|trim`, overflowed the stack (in the
  // parser, the evaluator, or the destructor of the tree). The depth of any node is at most the
  // parser's recursion (nested) plus the chain links made so far (each adds one level above what
  // it chains), so their sum bounds it. No chat template comes near.
  static constexpr int kMaxExprDepth = 512;
  struct Nested {
    explicit Nested(ExprParser& p) : parser(p) {
      ++parser.nested_;
      parser.check_depth();
    }
    ~Nested() { --parser.nested_; }
    ExprParser& parser;
  };
  void check_depth() const {
    if (nested_ + links_ > kMaxExprDepth)
      fail(line_, fmt::format("expression nested more than {} levels deep", kMaxExprDepth));
  }
  void link() {
    ++links_;
    check_depth();
  }
  template <class T>
  std::unique_ptr<T> make() {
    auto x = std::make_unique<T>();
    x->line = line_;
    return x;
  }
  ExprPtr binary(std::string op, ExprPtr a, ExprPtr b) {
    link();
    auto x = make<Binary>();
    x->op = std::move(op);
    x->a = std::move(a);
    x->b = std::move(b);
    return x;
  }
  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (is_name("or")) {
      ++p_;
      e = binary("or", std::move(e), and_expr());
    }
    return e;
  }
  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (is_name("and")) {
      ++p_;
      e = binary("and", std::move(e), not_expr());
    }
    return e;
  }
  ExprPtr not_expr() {
    const Nested nested(*this);
    if (is_name("not")) {
      ++p_;
      auto u = make<Unary>();
      u->op = "not";
      u->x = not_expr();
      return u;
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr e = additive();
    while (true) {
      if (t_[p_].type == Token::kOp &&
          (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">="))) {
        const std::string op = t_[p_++].text;
        e = binary(op, std::move(e), additive());
      } else if (is_name("in")) {
        ++p_;
        e = binary("in", std::move(e), additive());
      } else if (is_name("not") && t_[p_ + 1].type == Token::kName && t_[p_ + 1].text == "in") {
        p_ += 2;
        e = binary("not in", std::move(e), additive());
      } else if (is_name("is")) {
        ++p_;
        link();
        auto t = make<Test>();
        if (is_name("not")) {
          ++p_;
          t->negate = true;
        }
        if (t_[p_].type == Token::kOp && (is_op("==") || is_op("!="))) t->name = t_[p_++].text;
        else t->name = name();
        static const std::set<std::string> tests = {
            "defined", "undefined", "none",     "string", "number", "integer", "float",   "boolean", "true", "false",
            "mapping", "sequence",  "iterable", "even",   "odd",    "eq",      "equalto", "==",      "ne",   "!="};
        if (!tests.count(t->name)) fail(line_, fmt::format("test '{}' is not supported", t->name));
        t->x = std::move(e);
        if (is_op("(")) {
          ++p_;
          while (!is_op(")")) {
            t->args.push_back(expression());
            if (!is_op(")")) expect_op(",");
          }
          ++p_;
        } else if (!at_end() &&
                   (t_[p_].type == Token::kString || t_[p_].type == Token::kInt || t_[p_].type == Token::kFloat ||
                    (t_[p_].type == Token::kName && !is_name("and") && !is_name("or") && !is_name("else") &&
                     !is_name("if")))) {
          t->args.push_back(primary_postfix());
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  // jinja2's precedence: comparisons < + - < ~ < * / // % < ** < unary.
  ExprPtr additive() {
    ExprPtr e = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = t_[p_++].text;
      e = binary(op, std::move(e), concat());
    }
    return e;
  }
  ExprPtr concat() {
    ExprPtr e = multiplicative();
    while (is_op("~")) {
      ++p_;
      e = binary("~", std::move(e), multiplicative());
    }
    return e;
  }
  ExprPtr multiplicative() {
    ExprPtr e = power();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = t_[p_++].text;
      e = binary(op, std::move(e), power());
    }
    return e;
  }
  ExprPtr power() {
    ExprPtr e = unary();
    while (is_op("**")) {
      ++p_;
      e = binary("**", std::move(e), unary());
    }
    return e;
  }
  // Jinja binds a unary sign tighter than filters: -3|abs is (-3)|abs.
  ExprPtr unary(bool with_filter = true) {
    const Nested nested(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto u = make<Unary>();
      u->op = t_[p_++].text;
      u->x = unary(false);
      node = std::move(u);
    } else {
      node = primary_postfix();
    }
    return with_filter ? filters(std::move(node)) : std::move(node);
  }
  ExprPtr filters(ExprPtr e) {
    while (is_op("|")) {
      ++p_;
      link();
      auto f = make<Filter>();
      f->name = name();
      if (!kFilters.count(f->name)) fail(line_, fmt::format("filter '{}' is not supported", f->name));
      f->x = std::move(e);
      if (is_op("(")) f->args = call_args();
      e = std::move(f);
    }
    return e;
  }
  ArgExprs call_args() {
    expect_op("(");
    ArgExprs a;
    while (!is_op(")")) {
      if (t_[p_].type == Token::kName && t_[p_ + 1].type == Token::kOp && t_[p_ + 1].text == "=") {
        std::string k = name();
        ++p_;
        a.kw.emplace_back(std::move(k), expression());
      } else {
        a.pos.push_back(expression());
      }
      if (!is_op(")")) expect_op(",");
    }
    ++p_;
    return a;
  }
  ExprPtr primary_postfix() {
    ExprPtr e = primary();
    while (true) {
      if (is_op(".") || is_op("[") || is_op("(")) link();
      if (is_op(".")) {
        ++p_;
        auto a = make<Attr>();
        a->obj = std::move(e);
        a->name = t_[p_].type == Token::kInt ? std::to_string(t_[p_++].i) : name();
        e = std::move(a);
      } else if (is_op("[")) {
        ++p_;
        ExprPtr first;
        if (!is_op(":")) first = expression();
        if (is_op(":")) {
          auto s = make<Slice>();
          s->obj = std::move(e);
          s->start = std::move(first);
          ++p_;
          if (!is_op("]") && !is_op(":")) s->stop = expression();
          if (is_op(":")) {
            ++p_;
            if (!is_op("]")) s->step = expression();
          }
          expect_op("]");
          e = std::move(s);
        } else {
          expect_op("]");
          auto it = make<Item>();
          it->obj = std::move(e);
          it->key = std::move(first);
          e = std::move(it);
        }
      } else if (is_op("(")) {
        // Functions and methods are checked here, so a template is refused before rendering.
        static const std::set<std::string> functions = {"raise_exception", "namespace", "range"};
        static const std::set<std::string> methods = {"strip", "lstrip",     "rstrip",   "upper",   "lower",
                                                      "title", "startswith", "endswith", "replace", "split",
                                                      "items", "keys",       "values",   "get"};
        if (const auto* n = dynamic_cast<const Name*>(e.get()); n && !functions.count(n->name))
          fail(line_,
               fmt::format("function '{}' is not supported (raise_exception, namespace and range are)", n->name));
        if (const auto* at = dynamic_cast<const Attr*>(e.get()); at && !methods.count(at->name))
          fail(line_, fmt::format("method '{}' is not supported", at->name));
        if (dynamic_cast<const Name*>(e.get()) == nullptr && dynamic_cast<const Attr*>(e.get()) == nullptr)
          fail(line_, "only functions and methods can be called");
        auto c = make<Call>();
        c->fn = std::move(e);
        c->args = call_args();
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprPtr primary() {
    const Token& t = t_[p_];
    auto lit = [&](Value v) {
      auto l = make<Literal>();
      l->v = std::move(v);
      ++p_;
      return l;
    };
    switch (t.type) {
      case Token::kString: {
        std::string s = t.text;
        ++p_;
        while (t_[p_].type == Token::kString) s += t_[p_++].text;  // adjacent literals concatenate
        auto l = make<Literal>();
        l->v = Value::string(std::move(s));
        return l;
      }
      case Token::kInt: return lit(Value::integer(t.i));
      case Token::kFloat: return lit(Value::real(t.f));
      case Token::kName: {
        if (t.text == "true" || t.text == "True") return lit(Value::boolean(true));
        if (t.text == "false" || t.text == "False") return lit(Value::boolean(false));
        if (t.text == "none" || t.text == "None") return lit(Value::none());
        auto n = make<Name>();
        n->name = t.text;
        ++p_;
        return n;
      }
      case Token::kOp:
        if (t.text == "(") {
          ++p_;
          if (is_op(")")) {  // the empty tuple
            ++p_;
            auto l = make<ListExpr>();
            l->tuple = true;
            return l;
          }
          ExprPtr first = expression();
          if (is_op(",")) {  // tuple
            auto l = make<ListExpr>();
            l->tuple = true;
            l->items.push_back(std::move(first));
            while (is_op(",")) {
              ++p_;
              if (is_op(")")) break;
              l->items.push_back(expression());
            }
            expect_op(")");
            return l;
          }
          expect_op(")");
          return first;
        }
        if (t.text == "[") {
          ++p_;
          auto l = make<ListExpr>();
          while (!is_op("]")) {
            l->items.push_back(expression());
            if (!is_op("]")) expect_op(",");
          }
          ++p_;
          return l;
        }
        if (t.text == "{") {
          ++p_;
          auto d = make<DictExpr>();
          while (!is_op("}")) {
            ExprPtr k = expression();
            expect_op(":");
            d->items.emplace_back(std::move(k), expression());
            if (!is_op("}")) expect_op(",");
          }
          ++p_;
          return d;
        }
        [[fallthrough]];
      default: fail(line_, fmt::format("unexpected '{}'", t.type == Token::kEnd ? "end of expression" : t.text));
    }
  }

  std::vector<Token> t_;
  std::size_t p_ = 0;
  int line_;
  int nested_ = 0;  // Note [Expression depth]
  int links_ = 0;
};

// Raw pieces of the template after whitespace control.
struct Piece {
  enum Kind { kText, kExpr, kStmt } kind;
  std::string content;
  int line;
};

// Cuts the source into text, {{ }} and {% %} pieces (comments dropped), applying trim_blocks,
// lstrip_blocks and the -/+ modifiers as jinja2's lexer does.
std::vector<Piece> lex_template(std::string_view src) {
  std::vector<Piece> out;
  std::size_t i = 0;
  int line = 1;
  bool strip_next_ws = false;      // a "-%}" / "-}}" before
  bool trim_next_newline = false;  // trim_blocks after "%}" / "#}"
  const auto count_lines = [](std::string_view s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); };
  while (i <= src.size()) {
    std::size_t open = src.find('{', i);
    while (open != std::string_view::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
           src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open != std::string_view::npos && open + 1 >= src.size()) open = std::string_view::npos;
    std::string text(src.substr(i, open == std::string_view::npos ? std::string_view::npos : open - i));
    if (trim_next_newline) {
      if (text.starts_with("\r\n")) text.erase(0, 2);
      else if (text.starts_with("\n")) text.erase(0, 1);
    }
    if (strip_next_ws) text.erase(0, std::min(text.size(), text.find_first_not_of(" \t\r\n\x0b\x0c")));
    trim_next_newline = strip_next_ws = false;
    if (open == std::string_view::npos) {
      if (!text.empty()) out.push_back({Piece::kText, text, line});
      break;
    }
    const char kind = src[open + 1];
    std::size_t inner = open + 2;
    const bool minus_left = inner < src.size() && src[inner] == '-';
    const bool plus_left = inner < src.size() && src[inner] == '+';
    if (minus_left || plus_left) ++inner;
    if (minus_left) {
      text.erase(text.find_last_not_of(" \t\r\n\x0b\x0c") == std::string::npos
                     ? 0
                     : text.find_last_not_of(" \t\r\n\x0b\x0c") + 1);
    } else if (kind != '{' && !plus_left) {
      // lstrip_blocks: spaces and tabs between the start of the line (in the source) and a block tag.
      std::size_t k = open;
      while (k > 0 && (src[k - 1] == ' ' || src[k - 1] == '\t')) --k;
      if ((k == 0 || src[k - 1] == '\n') && k >= i) {
        const std::size_t n = open - k;
        if (n <= text.size()) text.erase(text.size() - n);
      }
    }
    if (!text.empty()) out.push_back({Piece::kText, text, line});
    line += count_lines(src.substr(i, open - i));
    const std::string_view close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    // Find the close, skipping string literals inside expressions and statements.
    std::size_t j = inner;
    char quote = 0;
    for (; j + 1 < src.size(); ++j) {
      if (kind != '#') {
        if (quote) {
          if (src[j] == '\\') ++j;
          else if (src[j] == quote) quote = 0;
          continue;
        }
        if (src[j] == '\'' || src[j] == '"') {
          quote = src[j];
          continue;
        }
      }
      if (src.substr(j, 2) == close) break;
    }
    if (j + 1 >= src.size()) fail(line, fmt::format("'{}' is never closed with '{}'", src.substr(open, 2), close));
    std::size_t end = j;
    const bool minus_right = end > inner && src[end - 1] == '-';
    const bool plus_right = !minus_right && kind == '%' && end > inner && src[end - 1] == '+';  // `+%}`: no trim_blocks
    if (minus_right || plus_right) --end;
    const std::string body(src.substr(inner, end - inner));
    if (kind == '{') out.push_back({Piece::kExpr, body, line});
    else if (kind == '%') out.push_back({Piece::kStmt, body, line});
    line += count_lines(src.substr(open, j + 2 - open));
    i = j + 2;
    strip_next_ws = minus_right;
    trim_next_newline = kind != '{' && !minus_right && !plus_right;
    if (i == src.size()) break;
  }
  return out;
}

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Piece> pieces) : p_(std::move(pieces)) {}

  Body parse_all() {
    Body b = parse_until({});
    if (pos_ < p_.size()) fail(p_[pos_].line, fmt::format("unexpected '{{% {} %}}'", keyword(p_[pos_])));
    return b;
  }

 private:
  static std::string keyword(const Piece& piece) {
    const auto t = tokenize(piece.content, piece.line);
    return t.front().type == Token::kName ? t.front().text : std::string();
  }

  // Parses nodes until a statement whose keyword is in `stops` (left unconsumed).
  Body parse_until(const std::set<std::string>& stops) {
    // Blocks nested deeper than this are refused (30,000 nested `if`/`for` overflowed the stack).
    constexpr int kMaxBlockDepth = 256;
    struct Depth {
      int& d;
      explicit Depth(int& depth) : d(++depth) {}
      ~Depth() { --d; }
    } depth(depth_);
    if (depth_ > kMaxBlockDepth)
      fail(pos_ < p_.size() ? p_[pos_].line : 0, fmt::format("blocks nested more than {} levels deep", kMaxBlockDepth));
    Body body;
    while (pos_ < p_.size()) {
      const Piece& piece = p_[pos_];
      if (piece.kind == Piece::kText) {
        auto t = std::make_unique<Text>();
        t->text = piece.content;
        body.push_back(std::move(t));
        ++pos_;
        continue;
      }
      if (piece.kind == Piece::kExpr) {
        ExprParser ep(tokenize(piece.content, piece.line), piece.line);
        auto o = std::make_unique<Output>();
        o->line = piece.line;
        o->e = ep.expression();
        ep.expect_end();
        body.push_back(std::move(o));
        ++pos_;
        continue;
      }
      const std::string kw = keyword(piece);
      if (stops.count(kw)) return body;
      body.push_back(statement());
    }
    if (!stops.empty()) fail(p_.empty() ? 1 : p_.back().line, fmt::format("missing '{{% {} %}}'", *stops.rbegin()));
    return body;
  }

  NodePtr statement() {
    const Piece& piece = p_[pos_++];
    ExprParser ep(tokenize(piece.content, piece.line), piece.line);
    const std::string kw = ep.name();
    if (kw == "if") {
      auto n = std::make_unique<If>();
      n->line = piece.line;
      ExprPtr cond = ep.expression();
      ep.expect_end();
      while (true) {
        Body b = parse_until({"elif", "else", "endif"});
        n->branches.emplace_back(std::move(cond), std::move(b));
        if (pos_ >= p_.size()) fail(piece.line, "missing '{% endif %}'");
        const Piece& next = p_[pos_++];
        ExprParser np(tokenize(next.content, next.line), next.line);
        const std::string k = np.name();
        if (k == "endif") {
          np.expect_end();
          return n;
        }
        if (k == "else") {
          np.expect_end();
          Body e = parse_until({"endif"});
          n->branches.emplace_back(nullptr, std::move(e));
          ++pos_;
          return n;
        }
        cond = np.expression();  // elif
        np.expect_end();
      }
    }
    if (kw == "for") {
      auto n = std::make_unique<For>();
      n->line = piece.line;
      n->targets.push_back(ep.name());
      while (ep.is_op(",")) {
        ep.skip();
        n->targets.push_back(ep.name());
      }
      if (!ep.is_name("in")) fail(piece.line, "expected 'in' in the for loop");
      ep.skip();
      n->iter = ep.or_only();
      if (ep.is_name("if")) {
        ep.skip();
        n->filter = ep.or_only();
      }
      if (ep.is_name("recursive")) fail(piece.line, "recursive loops are not supported");
      ep.expect_end();
      n->body = parse_until({"else", "endfor"});
      if (pos_ >= p_.size()) fail(piece.line, "missing '{% endfor %}'");
      if (keyword(p_[pos_]) == "else") {
        ++pos_;
        n->otherwise = parse_until({"endfor"});
      }
      ++pos_;
      return n;
    }
    if (kw == "set") {
      auto n = std::make_unique<Set>();
      n->line = piece.line;
      n->name = ep.name();
      if (ep.is_op(".")) {
        ep.skip();
        n->attr = ep.name();
      }
      if (!ep.is_op("=")) fail(piece.line, "block assignments ({% set x %}...{% endset %}) are not supported");
      ep.skip();
      n->value = ep.expression();
      ep.expect_end();
      return n;
    }
    fail(piece.line, fmt::format("'{{% {} %}}' is not supported (if, for and set are)", kw));
  }

  std::vector<Piece> p_;
  std::size_t pos_ = 0;
  int depth_ = 0;  // parse_until calls in progress
};

Value from_element(simdjson::dom::element e) {
  using T = simdjson::dom::element_type;
  switch (e.type()) {
    case T::OBJECT: {
      Value d = Value::make_dict();
      for (auto f : simdjson::dom::object(e)) d.set(std::string(f.key), from_element(f.value));
      return d;
    }
    case T::ARRAY: {
      List l;
      for (auto x : simdjson::dom::array(e)) l.push_back(from_element(x));
      return Value::make_list(std::move(l));
    }
    case T::STRING: return Value::string(std::string(std::string_view(e)));
    case T::INT64: return Value::integer(std::int64_t(e));
    case T::UINT64: throw Error("an integer above 2^63 - 1 is not supported");
    case T::DOUBLE: return Value::real(double(e));
    case T::BOOL: return Value::boolean(bool(e));
    default: return Value::none();
  }
}

}  // namespace

const Value* Value::find(std::string_view key) const {
  if (!dict) return nullptr;
  for (const auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}
Value* Value::find(std::string_view key) {
  if (!dict) return nullptr;
  for (auto& [k, v] : *dict)
    if (k == key) return &v;
  return nullptr;
}
void Value::set(const std::string& key, Value v) {
  if (Value* x = find(key)) *x = std::move(v);
  else dict->emplace_back(key, std::move(v));
}

std::string json_dumps(const Value& v) {
  std::string out;
  dumps(out, v);
  return out;
}

Value json_loads(std::string_view text) {
  simdjson::dom::parser parser;
  simdjson::dom::element e;
  const simdjson::padded_string padded(text);
  if (const auto err = parser.parse(padded).get(e); err)
    throw Error(fmt::format("invalid JSON: {}", simdjson::error_message(err)));
  return from_element(e);
}

struct Template::Impl {
  Body body;
};

Template::Template(std::string_view source) : impl_(std::make_unique<Impl>()) {
  // jinja2's keep_trailing_newline=False: one newline at the very end of the source is dropped.
  if (source.ends_with("\r\n")) source.remove_suffix(2);
  else if (source.ends_with("\n")) source.remove_suffix(1);
  impl_->body = TemplateParser(lex_template(source)).parse_all();
}
Template::~Template() = default;
Template::Template(Template&&) noexcept = default;
Template& Template::operator=(Template&&) noexcept = default;

std::string Template::render(const Dict& globals) const {
  Renderer r(globals);
  std::string out;
  render_body(impl_->body, r, out);
  return out;
}

}  // namespace modalities::core::data::jinja
