"""Stub generation at import: complete, importable, and safe when processes race to do it."""

import multiprocessing
import shutil
import uuid

from ddtree_serve.serve import protos


def _generate(tag: str) -> None:
    protos._generate(protos._proto_dir(), tag)


def test_concurrent_first_generation_yields_one_complete_package() -> None:
    tag = f"v_race_{uuid.uuid4().hex[:8]}"
    target = protos._GENERATED_DIR / tag
    try:
        context = multiprocessing.get_context("spawn")
        workers = [context.Process(target=_generate, args=(tag,)) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert [worker.exitcode for worker in workers] == [0, 0, 0, 0]
        assert sorted(p.name for p in target.iterdir()) == [
            "__init__.py",
            "ddtree_serve_pb2.py",
            "ddtree_serve_pb2_grpc.py",
        ]
        assert not [
            p for p in protos._GENERATED_DIR.iterdir() if p.name.startswith(f".{tag}")
        ]  # no staging left
    finally:
        shutil.rmtree(target, ignore_errors=True)


def test_generated_messages_round_trip_and_name_the_service() -> None:
    request = protos.pb2.GenerateRequest(
        prompt="hi", sampling=protos.pb2.SamplingParams(max_tokens=3, temperature=0.0)
    )
    decoded = protos.pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.sampling.HasField("temperature") and not decoded.sampling.HasField("top_p")
    assert protos.SERVICE_NAME == "ddtree_serve.v1.DDTreeServe"
    assert callable(protos.add_DDTreeServeServicer_to_server)
