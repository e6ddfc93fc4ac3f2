"""Dev models: small deterministic stand-ins of Qwen3.6-35B-A3B built on this machine."""

from iq36.devmodels.recipes import RECIPES, Recipe, get_recipe

__all__ = ["RECIPES", "Recipe", "get_recipe"]
