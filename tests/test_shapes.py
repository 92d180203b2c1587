"""rexrag_jax.shapes: the one "run a compiled larger program" rule, on hand-made shape sets."""
from rexrag_jax.shapes import covers, smallest_cover


def test_exact_shape_wins_when_compiled():
    assert smallest_cover({(8, 64), (16, 64), (8, 128)}, (8, 64), 4) == (8, 64)


def test_cheapest_cover_within_the_bound_else_the_wanted_shape():
    compiled = {(16, 128), (8, 256), (32, 64), (64, 512)}
    # (8, 64) wants 512: covers are (16,128)=2048, (8,256)=2048, (32,64)=2048 (ties by shape), (64,512) too big
    assert smallest_cover(compiled, (8, 64), 4) == (8, 256)
    assert list(covers(compiled, (8, 64), 4)) == [(8, 256), (16, 128), (32, 64)]
    assert smallest_cover(compiled, (8, 64), 3) == (8, 64)          # 2048 > 3 x 512: compile the exact one
    assert smallest_cover(compiled, (8, 64)) == (8, 256)           # no bound: any cover
    assert smallest_cover(compiled, (128, 8)) == (128, 8)          # nothing has 128 rows


def test_a_cover_must_be_at_least_as_large_in_every_dimension():
    assert smallest_cover({(4, 1024), (1024, 4)}, (8, 8)) == (8, 8)


def test_custom_cost_and_accept_and_deterministic_ties():
    compiled = {(8, 64, 512), (8, 64, 2048), (16, 32, 512), (4, 128, 1024)}
    rows_x_tokens = lambda k: k[0] * k[1]  # noqa: E731
    got = list(covers(compiled, (4, 32, 500), 4, cost=rows_x_tokens, accept=lambda k: k[2] <= 2 * 500))
    # cost 512 each (the bound: 4 x 128): ties broken by the shape; windows 1024 and 2048 exceed 2 x 500
    assert got == [(8, 64, 512), (16, 32, 512)]
    assert list(covers(compiled, (4, 32, 500), 4, cost=rows_x_tokens, accept=lambda k: k[2] <= 1024)) == \
        [(4, 128, 1024), (8, 64, 512), (16, 32, 512)]
    assert got == list(covers(list(reversed(sorted(compiled))), (4, 32, 500), 4, cost=rows_x_tokens,
                              accept=lambda k: k[2] <= 1000))


def test_one_dimensional_pack_lengths():
    assert smallest_cover({(512,), (1024,), (4096,)}, (600,), 2) == (1024,)
    assert smallest_cover({(512,), (4096,)}, (600,), 2) == (600,)
