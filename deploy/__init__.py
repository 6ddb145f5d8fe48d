"""Offline checks of the deployment: the Helm chart, its rendered objects and the Dockerfile.

`python -m deploy.check` (behind `make check-deploy`) renders `helm/charge-worker` with
Helm's own engine (the `helm-python-sdk` wheel embeds Helm's Go SDK), lints it, validates
the rendered objects against Kubernetes' and the custom resources' schemas, asserts the
properties the platform relies on (probes, grace period, security context, limits, secrets
by reference, one source for the alert rules) and lints the Dockerfile. No cluster, no
Docker engine. `tests/deploy/` runs the same checks under pytest.
"""
