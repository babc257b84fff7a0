"""Failure rehearsal: a two-stage pipeline (fetch → ask) that exercises the whole reliability core."""
