#!/usr/bin/env python3
"""Splits a perf profile of a training run into math kernels and host work (for
scripts/bench_host_overhead.sh --perf).

Input: `perf report --no-children --sort dso,sym` text. Each sample's symbol is put in one class:
  kernels      the inner loops that touch tensor data: ATen's vectorized/TensorIterator loops, MKL
               (BLAS, VML), Sleef, flash-attention and reduction kernels, memcpy/memset;
  allocator    malloc/free (LibTorch's CPU allocator calls them per tensor: glibc's, or the tcmalloc
               the modalities binary links) and page clearing;
  python       the interpreter and torch's Python bindings (PyTorch eager only);
  modalities   our own code: the modalities binary and libmodalities_*.so;
  torch host   everything else in LibTorch and the C/C++ runtime: dispatcher, TensorIterator
               setup, autograd engine, tensor construction, refcounts, TLS.
A heuristic on symbol names, stated as such. With --ms-per-step, each class is also given in ms.
Standard library only (run with python3); the profiled Python side is the .deps/bench venv
(scripts/setup_bench_env.sh).
"""
import argparse
import re
import sys

KERNEL = re.compile(r"VectorizedLoop|loop_2d_from_1d|basic_loop|vectorized_(inner|outer)_sum|mkl_|sgemm|Sleef_"
                    r"|cpu_flash_attention|__mem(move|set|cpy)|_kernel_impl|kernel_reduce|cpu_serial_kernel"
                    r"|fused_adam|_fused_")
ALLOC = re.compile(r"malloc|_int_free|cfree|unlink_chunk|memalign|clear_page|free@|^free$|__libc_free|sysmalloc")
LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[[.k]\]\s+(.*)$")


def classify(dso, sym):
    if KERNEL.search(sym):
        return "kernels"
    if ALLOC.search(sym) or dso.startswith(("libtcmalloc", "libjemalloc", "libmimalloc")):
        return "allocator"
    if dso.startswith("libpython") or dso.startswith("libtorch_python") or dso.startswith("python") \
            or ".cpython-" in dso:
        return "python"
    if dso.startswith("libmodalities") or dso == "modalities":
        return "modalities"
    return "torch host"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="perf report --no-children --sort dso,sym output (- for stdin)")
    ap.add_argument("--ms-per-step", type=float, help="measured ms per step, to express the classes in ms")
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    text = sys.stdin if args.report == "-" else open(args.report)
    share = {k: 0.0 for k in ("kernels", "allocator", "python", "modalities", "torch host")}
    for line in text:
        m = LINE.match(line)
        if m:
            share[classify(m.group(2), m.group(3))] += float(m.group(1))
    total = sum(share.values()) or 1.0
    parts = []
    for k, v in share.items():
        p = 100.0 * v / total
        ms = f" = {p / 100.0 * args.ms_per_step:.3f} ms" if args.ms_per_step else ""
        parts.append(f"{k} {p:.1f}%{ms}")
    host = 100.0 * (total - share["kernels"]) / total
    host_ms = f" = {host / 100.0 * args.ms_per_step:.3f} ms/step" if args.ms_per_step else ""
    print(f"{args.label}{'; '.join(parts)}; outside kernels {host:.1f}%{host_ms}")


if __name__ == "__main__":
    main()
