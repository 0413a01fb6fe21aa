"""Data lifecycle: retention (old request, pool and page data deleted per deployment) and
erasure (one tenant's records removed everywhere they are stored)."""
