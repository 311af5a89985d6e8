"""Llama 2/3/3.x (SmolLM2, TinyLlama): the plain recipe, rotary default or Llama 3.1's scaling."""

from pagedchat.model.family import Family, Gguf, uniform_layers

FAMILY = Family("LlamaForCausalLM", "llama", layers=uniform_layers, gguf=Gguf("llama", permuted_qk=True))
