"""Deliberately broken qscheme plugins (see README.md)."""
