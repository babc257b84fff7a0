"""PDF-to-XML conversion jobs (003): leased workers, a shared circuit breaker, manual retry, an API and a page."""
