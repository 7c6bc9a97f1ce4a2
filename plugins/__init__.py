"""Built-in kernel plugins, installed as the package ``qscheme_plugins``.

They register through the ``qscheme`` entry-point group exactly like third-party plugins.
"""
