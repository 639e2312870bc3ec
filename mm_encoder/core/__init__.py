"""The shared vocabulary of every mm-encoder process, torch-free: errors, model specs and the
registry, the wire format, the messages between processes, embedding handles, the prompt splice.
How the processes run (Dynamo's runtime, the process lifecycle) is `runtime/`."""
