"""Hugging Face GPT-2, BERT and Llama import and export with matching numerics (`mapping` runs the name tables of\njax3d.models.families)."""
from jax3d.hf.convert import export_hf, import_hf, load_hf_params, read_hf_folder, read_safetensors_file
from jax3d.hf.mapping import hf_config_from_model, model_config_from_hf, to_hf

__all__ = ["import_hf", "export_hf", "load_hf_params", "read_hf_folder", "read_safetensors_file", "model_config_from_hf",
           "hf_config_from_model", "to_hf"]
