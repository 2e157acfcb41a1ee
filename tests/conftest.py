import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# pytest-xdist (pyproject.toml) hands whole files to its workers in the order collected: the longest files go first,
# so that none of them is left to run alone at the end.
_LONGEST_FIRST = (
    "test_sharding.py",
    "test_convert.py",
    "test_docs.py",
    "test_demo.py",
    "test_models.py",
    "test_stacked.py",
    "test_attention.py",
    "test_quantizers.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: the rest keep their order


@pytest.fixture
def getkey():
    """A function that returns a fresh PRNG key at each call."""
    key = jax.random.key(0)

    def _getkey():
        nonlocal key
        key, subkey = jax.random.split(key)
        return subkey

    return _getkey
