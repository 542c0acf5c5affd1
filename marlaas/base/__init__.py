"""The one base model: the tiny built-in model, its pretraining, distribution through the store."""
