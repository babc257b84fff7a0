"""Criticizer (002 §8): fetch an artifact, ask the LLM for a structured critique, notify the requester."""
