"""kempnerforge: a Lightning trainer for decoder LLMs, MoE and VLMs on N-D parallel meshes."""

__version__ = "0.1.0"
