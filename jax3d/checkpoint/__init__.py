"""Checkpoints: saving and resuming (`checkpointer`), reading a checkpoint directory (`read`), the tokenizer a
checkpoint records and the one function that builds it again (`tokenizer`), what it records to recognise its
data and tokenizer files (`record`), and the export formats (`export`)."""
