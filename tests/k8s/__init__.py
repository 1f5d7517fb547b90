"""The Helm chart, checked without a cluster (``make check-k8s``; not part of ``make test``)."""
