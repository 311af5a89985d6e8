"""Mistral: Llama's shape with a sliding window over every layer."""

from pagedchat.model.family import Family, uniform_layers

# llama.cpp writes Mistral files as "llama" (without the window, which it does not apply): such a file loads as
# Llama, so this family reads safetensors folders only.
FAMILY = Family("MistralForCausalLM", "mistral", layers=uniform_layers)
