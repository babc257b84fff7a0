"""Document matching worker on SQS (seed 000): per-message flow, no silent degradation, one write transaction."""
