"""Evidence attach (004 Stage 1.3): file jobs from S3, attach through the case API, retry via outbox requeue, N1/N2."""
