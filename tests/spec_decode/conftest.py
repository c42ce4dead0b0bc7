"""The speculative-decoding tests' shared models (one session fixture: the modules only read them)."""

from tests.support.spec_models import spec_models  # noqa: F401 (the fixture)
