"""PEFT LoRA adapters made on the tiny model."""

from __future__ import annotations

import torch


def _make_adapter(base_dir, out_dir, targets, rank, seed, rslora=False):
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, use_rslora=rslora)
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)  # PEFT starts B at zero: the adapter would change nothing
    peft_model.save_pretrained(out_dir)
    return str(out_dir)
