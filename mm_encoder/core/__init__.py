"""The shared vocabulary of every mm-encoder process, torch-free: errors, model specs and the
registry, the wire format, the messages between processes, the prompt splice, Dynamo's names."""
