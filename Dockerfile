# The redrive code location image: one image for every service of docs/deploying.md (the gRPC code
# server, the conversion API and workers, the one-shot migration; Dagster's webserver and daemon can
# run it too, or Dagster's own images). Runtime dependencies are pinned by constraints.txt.
# Not built here: the development machine has no container engine (docs/deploying.md says how to check it).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home

# a fixed non-root uid, so volume permissions and Kubernetes' runAsNonRoot agree
RUN groupadd --system --gid 10001 redrive \
    && useradd --system --uid 10001 --gid redrive --home-dir /opt/redrive --shell /usr/sbin/nologin redrive

WORKDIR /opt/redrive

# dependencies first (their layer survives code changes), pinned; then the code, installed editable so
# that alembic.ini and migrations/ stay beside it (redrive.settings.PROJECT_ROOT is the source folder)
COPY pyproject.toml constraints.txt ./
COPY redrive/ redrive/
COPY devstack/ devstack/
COPY resources/ resources/
COPY assets/ assets/
COPY sensors/ sensors/
COPY orchestration/ orchestration/
COPY migrations/ migrations/
COPY alembic.ini dagster.yaml.example workspace.yaml ./
RUN pip install --constraint constraints.txt --editable . \
    && mkdir -p "$DAGSTER_HOME" /opt/redrive/.data \
    && cp dagster.yaml.example "$DAGSTER_HOME/dagster.yaml" \
    && chown -R redrive:redrive "$DAGSTER_HOME" /opt/redrive/.data

USER redrive

# the code server's port; the conversion API listens on 8090 when its command is given instead
EXPOSE 4000 8090

# the same command as devstack/topology.py's "code-server" service (tests/foundation/test_deploying.py)
CMD ["python", "-m", "orchestration.code_server", "-m", "orchestration.definitions", "--location-name", "redrive", "-h", "0.0.0.0", "-p", "4000", "--log-format", "json"]
