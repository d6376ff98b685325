"""Every jax3d tool's command line, and nothing else: parsers, flag -> config mapping, and each tool's
`main(argv)`. `launch/*.py` call these; library modules never import them. What `--load` takes from a checkpoint
where no flag says otherwise is jax3d.train.resume's, and the run itself jax3d.train.run's.

- `common`: the parser class and help format every tool uses, one-sentence errors, shared flag groups;
- `train_flags`, `train`: `launch/train.py` (Megatron-DeepSpeed's flag names -> `jax3d.config.Config`);
- `data`, `generate`, `evaluate`, `export`, `convert_hf`, `schedules`: the other tools.
"""
