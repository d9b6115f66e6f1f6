"""``python -m jaxdist.config``: print the configuration reference (Markdown tables, as in docs/configuration.md)."""

from jaxdist.config.load import reference_markdown

print(reference_markdown())
