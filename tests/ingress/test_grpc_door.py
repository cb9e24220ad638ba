"""The gRPC door's translations, in process: a router's GenerateRequest as the engine's request, the postproc's
token frames (sluice/postproc/token_frames.py) as the router's responses, and what --grpc refuses at start."""
from __future__ import annotations

import grpc
import msgspec
import pytest

from sluice.app.cli import config_from_args, parse_args
from sluice.ingress.grpc import check_options
from sluice.ingress.grpc import sglang_scheduler_pb2 as pb
from sluice.ingress.grpc.requests import ModelFacts, Outputs, Refused, constraint, engine_request
from sluice.ipc.messages import PostprocSpec, Started, bytes_to_ids, ids_to_bytes
from sluice.ipc.token_frames import TokenChunk, decode_chunks, encode_chunk
from sluice.postproc.request import RequestOutput
from sluice.render.structured import Constraint

MODEL = ModelFacts("m", max_model_len=64, vocab_size=100, eos_token_ids=(2,), num_shards=3)
TRT_MESSAGE = ("Argument 'tool_parser' is not supported when running in gRPC mode. The gRPC server is designed for "
               "use with external routers that handle these features (e.g., tool parsing, chat templates).")


def _request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(input_ids=[1, 5, 7]),
                              sampling_params=pb.SamplingParams(**{"temperature": 0.5, "top_p": 0.9, "top_k": -1,
                                                                   **sampling}))


def test_a_generate_request_becomes_the_engine_request_the_render_would_make():
    req = engine_request(_request(max_new_tokens=10, stop=["\n\n"], stop_token_ids=[9], logit_bias={"4": -1.5},
                                  min_new_tokens=3, repetition_penalty=0), "grpc-r", "ipc://reply", MODEL)
    assert bytes_to_ids(req.prompt_token_ids).tolist() == [1, 5, 7]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.min_tokens, s.repetition_penalty) == (10, 0.5, 0, 3, 1.0)
    assert abs(s.top_p - 0.9) < 1e-6
    assert s.stop_token_ids == (9, 2)  # the model's EOS after the request's own
    assert s.logit_bias == {4: -1.5}
    spec = msgspec.msgpack.decode(req.postproc_spec, type=PostprocSpec)
    assert (spec.endpoint, spec.reply_to, spec.stream, spec.stop, spec.skip_special_tokens) == \
        ("generate", "ipc://reply", True, ["\n\n"], False)
    assert req.shard < 3


def test_without_max_new_tokens_the_output_may_fill_the_context_and_ignore_eos_drops_the_eos():
    req = engine_request(_request(ignore_eos=True, n=2), "grpc-r", "a", MODEL)
    assert req.sampling.max_tokens == 64 - 3
    assert req.sampling.stop_token_ids == () and req.n == 2


@pytest.mark.parametrize("change, code", [
    (lambda r: r.mm_inputs.image_urls.append("http://x/y.png"), grpc.StatusCode.UNIMPLEMENTED),
    (lambda r: setattr(r, "lora_id", "adapter"), grpc.StatusCode.UNIMPLEMENTED),
    (lambda r: setattr(r.disaggregated_params, "bootstrap_host", "h"), grpc.StatusCode.UNIMPLEMENTED),
    (lambda r: r.tokenized.input_ids.append(100), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.tokenized.ClearField("input_ids"), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: setattr(r.sampling_params, "max_new_tokens", 62), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: setattr(r.sampling_params, "max_new_tokens", 0), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.sampling_params.logit_bias.update({"x": 1.0}), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: (setattr(r, "return_logprob", True), setattr(r, "top_logprobs_num", 21)),
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_what_the_door_refuses(change, code):
    r = _request()
    change(r)
    with pytest.raises(Refused) as e:
        engine_request(r, "grpc-r", "a", MODEL)
    assert e.value.code == code


def test_a_constraint_goes_to_the_renders_grammar_compiler_with_its_field_named():
    assert constraint(pb.SamplingParams()) is None
    assert constraint(pb.SamplingParams(regex="(yes|no)")) == Constraint("regex", "(yes|no)", "sampling_params.regex")
    assert constraint(pb.SamplingParams(json_schema='{"type": "object"}')) == \
        Constraint("json_schema", '{"type": "object"}', "sampling_params.json_schema")
    assert constraint(pb.SamplingParams(ebnf_grammar='root ::= "a"')).kind == "grammar"
    with pytest.raises(Refused) as e:
        constraint(pb.SamplingParams(structural_tag="{}"))
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
    req = engine_request(_request(regex="a"), "grpc-r", "a", MODEL, grammar="compiled",
                         grammar_param="sampling_params.regex")
    assert (req.grammar, req.grammar_param, req.grammar_trigger) == ("compiled", "sampling_params.regex", [])


def _chunk(index: int, ids: list[int], finish: str | None = None, stop: str | None = None) -> TokenChunk:
    return TokenChunk(index, ids_to_bytes(ids), 3, 1, finish, stop)


def test_a_stream_sends_each_frames_ids_then_how_each_choice_ended():
    out = Outputs("r", 2, (2,), stream=True, logprobs=False)
    first = out.feed([_chunk(0, [10, 11]), _chunk(1, [20])])
    assert [(r.chunk.index, list(r.chunk.token_ids), r.chunk.completion_tokens) for r in first] == \
        [(0, [10, 11], 2), (1, [20], 1)]
    assert first[0].chunk.prompt_tokens == 3 and first[0].chunk.cached_tokens == 1
    # A stop token ends choice 0 without being shown; a stop string ends choice 1.
    last = out.feed([_chunk(0, [12, 2], "stop"), _chunk(1, [21], "stop", "\n")])
    assert [r.WhichOneof("response") for r in last] == ["chunk", "complete", "chunk", "complete"]
    assert list(last[0].chunk.token_ids) == [12]
    assert last[1].complete.matched_token_id == 2 and last[1].complete.completion_tokens == 4
    assert last[1].complete.finish_reason == "stop" and not last[1].complete.output_ids  # (streamed already)
    assert last[3].complete.matched_stop_str == "\n" and last[3].complete.index == 1
    assert out.done and out.aborted() == []


def test_a_whole_output_comes_in_its_complete_and_an_abort_ends_the_choices_still_going():
    out = Outputs("r", 2, (2,), stream=False, logprobs=False)
    assert out.feed([_chunk(0, [10]), _chunk(1, [20])]) == []
    [done] = out.feed([_chunk(0, [11], "length")])
    assert list(done.complete.output_ids) == [10, 11] and done.complete.finish_reason == "length"
    [aborted] = out.aborted()
    assert (aborted.complete.index, aborted.complete.finish_reason) == (1, "abort")


def test_the_postproc_frames_token_ids_for_the_door():
    spec = PostprocSpec(request_id="r", endpoint="generate", model="m", created=0, reply_to="a", stream=True,
                        skip_special_tokens=False, stop=["xyz"])
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "xyz": 1, "b": 2}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    req = RequestOutput(spec, tok, Started("r", b"", 4, 2), lambda t: "")
    data = req.on_token(0, 0, None, None) + req.on_token(0, 2, None, None) + req.on_token(0, 1, None, None)
    chunks = decode_chunks(data + req.final().data)
    assert [bytes_to_ids(c.token_ids).tolist() for c in chunks] == [[0], [2], [1]]
    assert (chunks[-1].finish_reason, chunks[-1].stop) == ("stop", "xyz")
    assert (chunks[0].num_prompt_tokens, chunks[0].num_cached_tokens) == (4, 2)
    assert decode_chunks(encode_chunk(chunks[0]) + encode_chunk(chunks[1])) == chunks[:2]


def test_grpc_with_the_gpt_oss_parser_alias_fails_at_start_with_trtllm_serves_message():
    with pytest.raises(ValueError) as e:
        check_options("gpt_oss", None)
    assert str(e.value) == TRT_MESSAGE
    check_options("hermes", "think")  # a text parser is the HTTP API's business: the door bypasses it
    with pytest.raises(ValueError, match="Argument 'reasoning_parser' is not supported when running in gRPC mode"):
        check_options(None, "gpt_oss")
    # from the command line, before the model's own parser checks (tiny-chat is no gpt-oss)
    with pytest.raises(ValueError) as e:
        config_from_args(parse_args(["serve", "--grpc", "0", "--tool-parser", "gpt_oss"]))
    assert str(e.value) == TRT_MESSAGE
