"""Every jax3d tool's command line, and nothing else: parsers, flag -> config mapping, what a resumed run takes
from its checkpoint, and each tool's `main(argv)`. `launch/*.py` call these; library modules never import them.

- `common`: the parser class and help format every tool uses, one-sentence errors, shared flag groups;
- `train_flags`, `train`: `launch/train.py` (Megatron-DeepSpeed's flag names -> `jax3d.config.Config`);
- `resume`: what `--load` takes from a checkpoint where no flag says otherwise;
- `data`, `generate`, `evaluate`, `export`, `convert_hf`, `schedules`: the other tools.
"""
