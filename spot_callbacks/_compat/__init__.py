"""Every private Lightning and Transformers API spot_callbacks touches."""
