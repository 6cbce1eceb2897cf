"""The boundary rows of a stage before the final one (skippyd/stage/boundary.py) count in its memory: the deploy
planner's need of each stage, and the status of a running one."""

from __future__ import annotations

import numpy as np

from skippyd.deploy.planner import ModelShape, model_shape, stage_memory
from skippyd.stage.boundary import BoundaryRows

MIB = 1 << 20


def test_a_stage_before_the_final_one_needs_its_boundary_rows():
    shape = ModelShape(name="m", n_layer=4, layer_bytes=(MIB,) * 4, first_bytes=MIB, last_bytes=MIB,
                       layer_costs=(1,) * 4, head_cost=1, kv_bytes_per_layer_token=1024, n_embd=576)
    kw = dict(ctx=2048, lanes=4, margin_bytes=0, margin_fraction=0.0)
    rows = 4 * 576 * 2048 * 4  # float32 rows, a position of every lane's context each
    assert shape.boundary_bytes(2, ctx=2048, lanes=4) == rows and shape.boundary_bytes(4, ctx=2048, lanes=4) == 0
    first = shape.weight_bytes(0, 2) + shape.kv_bytes(0, 2, ctx=2048, lanes=4)
    last = shape.weight_bytes(2, 4) + shape.kv_bytes(2, 4, ctx=2048, lanes=4)
    assert stage_memory(shape, 0, 2, **kw) == first + rows
    assert stage_memory(shape, 2, 4, **kw) == last  # the final stage records none
    assert stage_memory(shape, 0, 4, **kw) == shape.weight_bytes(0, 4) + shape.kv_bytes(0, 4, ctx=2048, lanes=4)


def test_the_model_shape_knows_the_rows_width(default_model_path):
    assert model_shape(default_model_path).n_embd == 576


def test_the_rows_buffer_says_what_it_takes():
    rows = BoundaryRows()
    assert rows.nbytes == 0
    rows.wrote(0, np.zeros((10, 8), np.float32))
    assert rows.nbytes == 256 * 8 * 4  # grown ahead of what is held: 256 rows at least
    rows.wrote(10, np.zeros((300, 8), np.float32))
    assert rows.nbytes == 512 * 8 * 4 and rows.held == 310
