// Placeholder: packing tests follow once the tokenizer plugin lands.
