"""Bridges to other tools that need their own optional packages (lm-eval); import the submodule you need."""
