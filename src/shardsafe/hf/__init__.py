"""Hugging Face model folders: what counts as a model (guard), export, save_pretrained, load_pretrained, push."""

__all__: list[str] = []
