"""LoRA adapters: loading PEFT directories, several per batch, and checking their files before they load."""
