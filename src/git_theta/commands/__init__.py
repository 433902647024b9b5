"""The command line: thin commands over the layers below."""
