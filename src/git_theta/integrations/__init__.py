"""Integrations with training libraries, each importing its library only when used:
``git_theta.integrations.transformers.GitThetaCallback``."""
