"""Where the batch lives in a call: argument signatures, output batch axes, tensor pytrees."""
