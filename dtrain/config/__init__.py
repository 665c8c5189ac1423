"""The one typed source of truth for configuration: sections, their checks, loading."""
