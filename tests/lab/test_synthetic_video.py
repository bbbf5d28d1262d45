import itertools

import numpy as np
import pytest

from cords_vllm.lab.synthetic import encode_mp4, jpeg_frames_data_url, make_video, video_tokens


def test_same_seed_same_bytes_and_different_seed_differs():
    a = make_video(24, 112, 140, seed=7)
    b = make_video(24, 112, 140, seed=7)
    c = make_video(24, 112, 140, seed=8)
    assert a.frames.tobytes() == b.frames.tobytes()
    assert a.frames.tobytes() != c.frames.tobytes()
    assert (a.needle_frames, a.needle_colour, a.repeated_frames) == (b.needle_frames, b.needle_colour,
                                                                     b.repeated_frames)


@pytest.mark.parametrize(("frames", "height", "width"), [(2, 28, 28), (16, 224, 224), (48, 112, 168)])
def test_requested_frame_count_and_size(frames, height, width):
    v = make_video(frames, height, width, seed=1)
    assert v.frames.shape == (frames, height, width, 3)
    assert v.frames.dtype == np.uint8
    assert v.num_frames == frames


def test_structure_is_what_the_metadata_says():
    v = make_video(64, 112, 112, seed=3, scene_length=8, static_fraction=0.5, repeat_fraction=0.2,
                   needle_position=0.25, needle_colour="red")
    # needle: one temporal patch, a saturated red square, unlike every other frame
    assert v.needle_frames == (16, 17)
    centre = v.frames[16, 56, 56]
    assert tuple(centre) == (230, 25, 25)
    others = np.delete(v.frames, v.needle_frames, axis=0).reshape(-1, 3)
    assert not np.any(np.all(others == (230, 25, 25), axis=1))
    # repeated frames are exact copies of earlier ones
    assert v.repeated_frames
    for frame, source in v.repeated_frames:
        assert source < frame
        assert np.array_equal(v.frames[frame], v.frames[source])
    # static scenes do not change within the scene (except where a repeat or the needle was pasted in)
    special = {f for f, _ in v.repeated_frames} | set(v.needle_frames)
    for s in v.static_scenes:
        start = v.scene_starts[s]
        frames = [t for t in range(start, min(start + 8, 64)) if t not in special]
        for t in frames[1:]:
            assert np.array_equal(v.frames[t], v.frames[frames[0]])
    # scenes change: first frames of consecutive scenes differ
    firsts = [v.frames[s] for s in v.scene_starts]
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(firsts))


def test_encoders_roundtrip():
    import base64

    import cv2

    v = make_video(8, 112, 112, seed=0)
    data = encode_mp4(v.frames, fps=4)
    assert data[4:8] == b"ftyp"
    path_frames = []
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        cap = cv2.VideoCapture(f.name)
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            path_frames.append(frame)
    assert len(path_frames) == 8
    url = jpeg_frames_data_url(v.frames)
    assert url.startswith("data:video/jpeg;base64,")
    assert len(url.split(",")) == 1 + 8
    base64.b64decode(url.split(",")[1], validate=True)


def test_video_token_count():
    assert video_tokens(32, 224, 224) == 1024
    assert video_tokens(64, 112, 112) == 512


@pytest.mark.parametrize("kwargs", [{"num_frames": 3}, {"num_frames": 0}, {"height": 10},
                                    {"needle_position": 1.0}, {"needle_colour": "mauve"},
                                    {"static_fraction": 2.0}])
def test_bad_arguments_are_rejected_by_name(kwargs):
    args = {"num_frames": 8, "height": 56, "width": 56, **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        make_video(**args)


def test_encoders_reject_malformed_frames():
    with pytest.raises(ValueError, match="frames"):
        encode_mp4(np.zeros((4, 8, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="frames"):
        jpeg_frames_data_url(np.zeros((4, 8, 8, 3), dtype=np.float32))
