"""The OpenAI-compatible serving door: model names (`names`) and the wire format (`wire`)."""
