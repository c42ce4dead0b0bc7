"""The speculative-decoding tests' shared models (a module-scoped fixture per test module)."""

from tests.support.spec_models import spec_models  # noqa: F401 (the fixture)
