import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import chain_trace, shared_reference
from triosim.common.errors import TraceError
from triosim.trace.go_csv import import_triosim_csv
from triosim.trace.model import CATEGORIES, PHASES, Operator, Tensor, Trace, load, save

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def traces(draw):
    n_t = draw(st.integers(1, 8))
    tensors = {
        i: Tensor(
            i,
            tuple(draw(st.lists(st.integers(0, 64), max_size=3))),
            draw(st.sampled_from(["float32", "float16", "int64"])),
            draw(finite),
            draw(st.sampled_from(CATEGORIES)),
        )
        for i in range(n_t)
    }
    ids = st.lists(st.integers(0, n_t - 1), max_size=4).map(tuple)
    n_o = draw(st.integers(1, 10))
    ops = [
        Operator(
            i,
            draw(st.text(min_size=1, max_size=12)),
            draw(st.text(max_size=12)),
            draw(st.sampled_from(PHASES)),
            draw(finite),
            draw(ids),
            draw(ids),
            draw(st.none() | finite),
            None,
            draw(st.integers(1, 5)),
            draw(st.booleans()),
        )
        for i in range(n_o)
    ]
    meta = draw(
        st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)
    )
    return Trace(ops, tensors, meta)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # saving is I/O: no time limit
@given(t=traces(), gz=st.booleans())
def test_save_load_round_trip(tmp_path, t, gz):
    path = save(t, tmp_path / ("t.trace.json.gz" if gz else "t.trace.json"))
    back = load(path)
    assert back.operators == t.operators
    assert back.tensors == t.tensors
    assert back.metadata == t.metadata


def _write(tmp_path, mutate):
    path = save(chain_trace(), tmp_path / "t.trace.json")
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    return path


def _message(e, path) -> str:
    """The error's message without the file's path (pytest names the folder after the test,
    so words of the test's name would be found in the path)."""
    return str(e.value).replace(str(path), "<file>")


def _col(doc, table, name):
    return doc[table]["columns"].index(name)


def test_missing_column_names_file_and_field(tmp_path):
    def drop(doc):
        k = _col(doc, "operators", "time")
        doc["operators"]["columns"].pop(k)
        for r in doc["operators"]["rows"]:
            r.pop(k)

    path = _write(tmp_path, drop)
    with pytest.raises(TraceError) as e:
        load(path)
    assert e.value.field == "time" and f"file {path}," in str(e.value)


def test_negative_time_names_row_and_field(tmp_path):
    path = _write(
        tmp_path,
        lambda d: d["operators"]["rows"][2].__setitem__(_col(d, "operators", "time"), -1.0),
    )
    with pytest.raises(TraceError) as e:
        load(path)
    assert (e.value.row, e.value.field) == (2, "time") and "row 2" in _message(e, path)


def test_undefined_tensor_id_names_row_and_field(tmp_path):
    path = _write(
        tmp_path,
        lambda d: d["operators"]["rows"][1].__setitem__(_col(d, "operators", "inputs"), [999]),
    )
    with pytest.raises(TraceError) as e:
        load(path)
    assert (e.value.row, e.value.field) == (1, "inputs") and "999" in _message(e, path)


def test_duplicated_operator_id(tmp_path):
    path = _write(tmp_path, lambda d: d["operators"]["rows"][3].__setitem__(0, 0))
    with pytest.raises(TraceError) as e:
        load(path)
    # the folder pytest made is named after this test and so holds "duplicated" itself:
    # look for the words in the message with the path taken out
    assert (e.value.row, e.value.field) == (3, "id")
    assert "duplicated operator id 0" in _message(e, path)


def test_gzip_and_wrong_version(tmp_path):
    path = save(chain_trace(), tmp_path / "t.trace.json.gz")
    doc = json.loads(gzip.open(path, "rt").read())
    doc["format_version"] = 99
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(TraceError, match="format_version"):
        load(path)


TRACE_CSV = """OperatorID,OperatorName,Operator_input,Operator_output,Operator_cudatime,Operator_cudatimenooverlap,InputSize,OutputSize,gpuid,stage,tpflag
1,aten::linear,[1; 2],[3],12,10,[32; 16],[8],0,forward,1
2,autograd::engine::evaluate_function: AddmmBackward0,[3; 2],[4],25,20,[8; 16],[16],0,backward,1
3,aten::_foreach_add_,[2; 4],[],7,5,[16; 16],[],0,optimizer,0
"""
TENSOR_CSV = """Index,TensorID,TensorShape,TensorNumElement,TensorEachByte,TensorType,TensorStorgeid,gpuid
0,1,"[4, 8]",32,4,input,1,0
1,2,"[2, 8]",16,4,weight,2,0
2,3,"[4, 2]",8,4,output,3,0
3,4,"[2, 8]",16,4,input,4,0
4,2,"[2, 8]",16,4,input,2,0
"""


def test_triosim_csv_importer(tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE_CSV)
    (tmp_path / "tensor.csv").write_text(TENSOR_CSV)
    t = import_triosim_csv(tmp_path)
    assert [o.phase for o in t.operators] == ["forward", "backward", "optimizer"]
    assert t.total_time == pytest.approx(35e-6)  # the no-overlap column, in seconds
    assert t.tensors[2].category == "weight"  # although its last row says "input"
    assert t.tensors[4].category == "gradient"
    assert t.tensors[1].nbytes == 128 and t.tensors[1].shape == (4, 8)
    assert t.batch_size == 4 and t.operators[0].tp_split


def test_triosim_csv_errors(tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE_CSV.replace("[1; 2],[3]", "[1; 7],[3]"))
    (tmp_path / "tensor.csv").write_text(TENSOR_CSV)
    with pytest.raises(TraceError) as e:
        import_triosim_csv(tmp_path)
    assert e.value.row == 2 and e.value.field == "Operator_input"
    (tmp_path / "trace.csv").write_text(TRACE_CSV.replace(",stage,", ",phase,"))
    with pytest.raises(TraceError, match="missing column 'stage'"):
        import_triosim_csv(tmp_path)
    (tmp_path / "trace.csv").write_text(TRACE_CSV.replace(",10,", ",-10,"))
    with pytest.raises(TraceError) as e:
        import_triosim_csv(tmp_path)
    assert e.value.field == "Operator_cudatimenooverlap"


@pytest.mark.parametrize("model,expected_ms", [("vgg13", 94.038), ("resnet50", 70.723)])
def test_original_traces_replay(model, expected_ms):
    from triosim.simulation.wiring import Simulation

    t = import_triosim_csv(shared_reference("triosim-go-traces") / model)
    r = Simulation({"num_gpus": 1}, trace=t).run()
    assert r.iteration_time * 1e3 == pytest.approx(expected_ms, abs=1e-9)


def test_shared_reference_lookup_order(tmp_path, monkeypatch):
    # <repo>/shared/reference first, then <repo>/../shared/reference, then $TRIOSIM_SHARED
    import tests.conftest as c

    repo, env = tmp_path / "clone" / "repo", tmp_path / "elsewhere"
    monkeypatch.setattr(c, "ROOT", repo)
    monkeypatch.setenv("TRIOSIM_SHARED", str(env))
    with pytest.raises(pytest.skip.Exception, match="TRIOSIM_SHARED"):
        c.shared_reference("go")
    for d in (env, repo.parent / "shared", repo / "shared"):  # each new one takes precedence
        (d / "reference" / "go").mkdir(parents=True)
        assert c.shared_reference("go") == d / "reference" / "go"
