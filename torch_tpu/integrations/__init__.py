"""Integrations with the libraries PyTorch users train with: Hugging Face accelerate (and so
``transformers.Trainer``), Lightning, and inductor (plain ``torch.compile``).

Each installs itself when its library finishes importing (a post-import hook set up by
``_torch_tpu_autoload``), so torch_tpu never imports a library the user does not use.
"""
