"""Data preparation: the tokenizer, `nmoe prep` and the embedded corpus, apart from training."""
