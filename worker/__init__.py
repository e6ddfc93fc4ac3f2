"""The process that holds the model: identity checks, engines, tokenizer, sampling."""
