"""The WASTE container: a model laid out for the engine (docs/CONTAINER.md).

`open_container(path)` reads one; `convert(hf_dir, out, quant=...)` writes one from a
Hugging Face checkpoint.
"""

from waste.container.format import FORMAT_VERSION, MAGIC, ContainerError, expected_expert_tensors, expected_tensors
from waste.container.reader import Container, open_container

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "Container",
    "ContainerError",
    "expected_expert_tensors",
    "expected_tensors",
    "open_container",
]
