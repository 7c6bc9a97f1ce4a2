"""Built-in scheme descriptors (YAML data), installed as the package ``qscheme_schemes``."""
