"""Model modules and their weights: the family-neutral machinery and one subpackage per model family."""
