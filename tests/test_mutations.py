"""The most dangerous mutations (issue 10): each is applied to a temporary copy of ``src/`` and named tests run
against the copy must FAIL. A mutation here is a bug that corrupts data silently (wrong tokens, wrong order,
a damaged page read as good, a rank loading another rank's samples): if its tests stop catching it, this fails.

Each mutation is an exact source-text replacement that must match exactly once (``test_every_mutation_applies``
checks that in the default run, so a refactor that moves a line fails fast and the entry is updated with it).
The slow test runs each mutation in a subprocess (``PYTHONPATH`` = the mutated copy), two at a time; the named
tests are narrow so that the whole list takes a few minutes on 2 cores. ``tools/mutation.py`` (mutmut) is the
broad, generated counterpart; this list is hand-picked and runs in CI.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pageset"


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to src/pageset
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids, relative to the repository root


TL = "tests/test_token_loader.py::test_windows_cover_every_target_once"
MUTATIONS = [
    # -- the four planted bugs of the issue
    Mutation("token window start steps by seq_len + 1 (process page cache)", "load/stages.py",
             "return self.data_offset + ids * (self.seq_len * self.itemsize), np.full(",
             "return self.data_offset + ids * ((self.seq_len + 1) * self.itemsize), np.full(",
             (f"{TL}[16-sequential-process]",)),
    Mutation("verify_pages checks only a record's first page", "load/pages.py",
             "for k in range(int(first[j]), min(int(last[j]), self.done.size - 1) + 1):",
             "for k in range(int(first[j]), int(first[j]) + 1):",
             ("tests/test_loader.py::test_verify_pages_checks_both_pages_of_a_token_window",
              "tests/test_loader.py::test_verify_pages_checks_every_page_of_a_record_spanning_pages")),
    Mutation("ranks swapped in the loader", "load/epoch.py",
             "start = self._base + step * self.global_batch_size + self.dist.rank * B",
             "start = self._base + step * self.global_batch_size + (self.dist.world_size - 1 - self.dist.rank) * B",
             ("tests/test_loader.py::test_state_dict_resume_matches_control",)),
    Mutation("token windows read at stride seq_len + 1 (one kernel call per batch)", "load/stages.py",
             "self.stride = self.seq_len * self.itemsize",
             "self.stride = (self.seq_len + 1) * self.itemsize",
             (f"{TL}[16-random-os]",)),
    Mutation("cached token windows copied one token late", "ops/tokens.py",
             "offsets[j] = page_slot[k] * page_len + s - k * page_len",
             "offsets[j] = page_slot[k] * page_len + s - k * page_len + 1",
             ("tests/test_spans.py::test_pin_copy_unpin_windows_out_of_a_slot_arena", f"{TL}[100-random-process]")),
    Mutation("token targets are the inputs (the batch kernels' shift lost)", "ops/tokens.py",
             "b[i] = src[i + np.uint64(1)]",
             "b[i] = src[i]",
             ("tests/test_spans.py::test_pread_windows_reads_widens_and_reports_the_first_short_window",)),
    Mutation("verify() skips the last page", "read/file_access.py",
             "for k in range(page_count):\n            start = data_offset + k * page_size",
             "for k in range(page_count - 1):\n            start = data_offset + k * page_size",
             ("tests/test_read_errors.py::test_verify_checks_every_page_first_middle_and_last",)),
    # -- order: sharding, shuffle, keys, state
    Mutation("rank slices in reverse rank order", "order/sharding.py",
             "start = s * global_batch + r * b",
             "start = s * global_batch + (world_size - 1 - r) * b",
             ("tests/test_order.py::test_rank_streams_partition_the_epoch",)),
    Mutation("Fisher-Yates draws j < i (Sattolo: never a fixed point)", "order/shuffle.py",
             "j = np.int64(randbelow(key_step(base, i), i + 1))",
             "j = np.int64(randbelow(key_step(base, i), i))",
             ("tests/test_order.py::test_fisher_yates_twins",)),
    Mutation("quasi-random windows drop their last page", "order/shuffle.py",
             "for q in range(w * window_pages, min((w + 1) * window_pages, n_pages)):",
             "for q in range(w * window_pages, min((w + 1) * window_pages, n_pages) - 1):",
             ("tests/test_order.py::test_epoch_permutation_is_a_bijection_equal_to_its_twin",)),
    Mutation("sample keys ignore the epoch", "order/keys.py",
             "    h = splitmix64(numba.uint64(seed))\n    h = splitmix64(h ^ numba.uint64(epoch))\n"
             "    h = splitmix64(h ^ numba.uint64(tag))\n    return splitmix64(h ^ numba.uint64(i))",
             "    h = splitmix64(numba.uint64(seed))\n    h = splitmix64(h)\n"
             "    h = splitmix64(h ^ numba.uint64(tag))\n    return splitmix64(h ^ numba.uint64(i))",
             ("tests/test_keys.py::test_key_twins_and_stream_split",)),
    Mutation("a state saved at the epoch end repeats the epoch", "order/state.py",
             "    if cursor == epoch_length:\n        return epoch + 1, 0",
             "    if cursor == epoch_length:\n        return epoch, 0",
             ("tests/test_order.py::test_normalize_cursor",)),
    Mutation("the loader's cursor lags one batch (resume repeats it)", "load/epoch.py",
             "self._cursor = base + (step + 1) * G\n                self._prefetch_to_device(",
             "self._cursor = base + step * G\n                self._prefetch_to_device(",
             ("tests/test_loader.py::test_state_dict_resume_matches_control",)),
    Mutation("the cursor of inline (token) batches lags one batch", "load/epoch.py",
             "self._cursor = base + (step + 1) * G\n            if len(times)",
             "self._cursor = base + step * G\n            if len(times)",
             ("tests/test_resume_contract.py::test_token_resume_contract",)),
    # -- token windows
    Mutation("one window too many (reads past the stream)", "ops/tokens.py",
             "return (int(num_tokens) - 1) // int(seq_len)",
             "return int(num_tokens) // int(seq_len)",
             ("tests/test_tokens.py::test_window_properties",)),
    Mutation("targets are the inputs (no shift)", "ops/tokens.py",
             'np.copyto(out_target, scratch[:, 1:], casting="unsafe")',
             'np.copyto(out_target, scratch[:, :-1], casting="unsafe")',
             ("tests/test_tokens.py::test_window_properties",)),
    Mutation("labels masked where the TARGET is EOS", "ops/tokens.py",
             "out[inputs == eos_id] = IGNORE_INDEX",
             "out[targets == eos_id] = IGNORE_INDEX",
             ("tests/test_tokens.py::test_document_outputs_edge_cases",)),
    Mutation("segments start at the EOS instead of after it", "ops/tokens.py",
             "np.equal(inputs[:, :-1], eos_id, out=starts[:, 1:])",
             "np.equal(inputs[:, 1:], eos_id, out=starts[:, 1:])",
             ("tests/test_tokens.py::test_document_outputs_edge_cases",)),
    Mutation("windows per page counted with floor (order over windows shifts)", "load/stages.py",
             "first = np.minimum(-(-bounds // stride), self.n_records)",
             "first = np.minimum(bounds // stride, self.n_records)",
             ("tests/test_token_loader.py::test_windows_per_page_count_window_starts[100]",)),
    # -- image crop boxes and resize kernels
    Mutation("RandomResizedCrop never touches the bottom row", "ops/crop.py",
             "y0 = _randint(key, c + 2, height - h + 1)",
             "y0 = _randint(key, c + 2, height - h)",
             ("tests/test_image_ops.py::test_random_resized_crop_golden",
              "tests/test_image_ops.py::test_random_resized_crop_box_properties")),
    Mutation("CenterCrop height from the output width", "ops/crop.py",
             "h = max(int(side * (out_h / longest)), 1)",
             "h = max(int(side * (out_w / longest)), 1)",
             ("tests/test_image_ops.py::test_center_crop_box_non_square_keeps_output_aspect",
              "tests/test_loader.py::test_center_crop_matches_reference")),
    Mutation("resize samples pixel corners, not centres", "ops/resize_weights.py",
             "center = np.float64(in0) + (xx + 0.5) * scale",
             "center = np.float64(in0) + xx * scale",
             ("tests/test_image_ops.py::test_resize_equals_pillow_sweep",)),
    Mutation("horizontal flip off by one column", "ops/resize.py",
             "        o = 3 * (out_w - 1 - xx) if flip else 3 * xx\n        dst_a[o] = _clip8(a0)",
             "        o = 3 * ((out_w - xx) % out_w) if flip else 3 * xx\n        dst_a[o] = _clip8(a0)",
             ("tests/test_image_ops.py::test_flip_equals_np_flip",)),
    Mutation("a mixture sample's index in its source counted from the slot, not the source's rank",
             "order/mixture.py", "k = base[s] + (g // period) * q[s] + rank[r]", "k = base[s] + (g // period) * q[s] + r",
             ("tests/test_mixtures.py::test_golden_vectors",
              "tests/test_mixtures.py::test_lookup_kernel_equals_per_position_orders")),
    Mutation("a mixture lookup reads one id past a cached order window", "order/mixture.py",
             "        t = 2 * s\n        if windows[0, t] != epoch or not windows[1, t] <= pos < windows[1, t] + windows[2, t]:",
             "        t = 2 * s\n        if windows[0, t] != epoch or not windows[1, t] <= pos <= windows[1, t] + windows[2, t]:",
             ("tests/test_mixtures.py::test_lookup_kernel_equals_per_position_orders",)),
    Mutation("a mixture's scattered image rows written at their slice positions", "ops/image_batch.py",
             "num, den, flips[j], table, out[rows[j]], channels_last, fast, decoded,",
             "num, den, flips[j], table, out[j], channels_last, fast, decoded,",
             ("tests/test_mixtures.py::test_image_rows_written_in_place_equal_the_copied_rows",)),
    Mutation("the metadata section flagged required (an older reader would refuse the file)", "write/assemble.py",
             "(C.SECTION_METADATA, 0, canonical_json(",
             "(C.SECTION_METADATA, C.SECTION_FLAG_REQUIRED, canonical_json(",
             ("tests/test_reference_write.py::test_section_flags_and_metadata_as_the_spec_says",)),
    Mutation("weights stay put when a padded tap window moves left", "ops/resize.py",
             "            s = t - shift\n",
             "            s = t\n",
             ("tests/test_image_ops.py::test_resize_equals_pillow_sweep",)),
    Mutation("horizontal flip off by one column (vertical-first order)", "ops/resize.py",
             "        o = 3 * (out_w - 1 - xx) if flip else 3 * xx\n        acc[o] = s0",
             "        o = 3 * ((out_w - xx) % out_w) if flip else 3 * xx\n        acc[o] = s0",
             ("tests/test_image_ops.py::test_flip_equals_np_flip",)),
    # -- page access, checksums, packing
    Mutation("process page cache reads a record one byte late", "load/pages.py",
             "rec_slot * self.page_size + rel[cached] % self.page_size, -1)",
             "rec_slot * self.page_size + rel[cached] % self.page_size + 1, -1)",
             (f"{TL}[100-random-process]",)),
    Mutation("records straddle page boundaries", "write/packing.py",
             "start = cursor if cursor + length <= page_end else page_end",
             "start = cursor",
             ("tests/test_properties.py::test_place_record_never_straddles",)),
    Mutation("a large record does not own its last page", "write/packing.py",
             "return start, -(-end // page_size) * page_size",
             "return start, end",
             ("tests/test_properties.py::test_place_record_never_straddles",)),
    # -- write paths checked against the reference reader (issue 18, tests/test_reference_write.py)
    Mutation("WebDataset source keeps reading the first shard it opened", "write/external.py",
             "            if self._open is None or self._open[0] != s:",
             "            if self._open is None:",
             ("tests/test_reference_write.py::test_webdataset_several_shards",)),
    Mutation("Parquet source caches a row group by its number inside the file (serves another file's rows)",
             "write/external.py",
             "        if self._cached is None or self._cached[0] != g:\n            import fsspec\n"
             "            import pyarrow.parquet as pq\n\n            path, rg = self._groups[g]",
             "        path, rg = self._groups[g]\n        if self._cached is None or self._cached[0] != rg:\n"
             "            import fsspec\n            import pyarrow.parquet as pq\n\n            g = rg",
             ("tests/test_reference_write.py::test_parquet_several_files",)),
    Mutation("merge copies a damaged short last page", "merge.py",
             "            if self.crcs is not None and zlib.crc32(data)",
             "            if self.crcs is not None and k < len(self.crcs) - 1 and zlib.crc32(data)",
             ("tests/test_reference_write.py::test_merge_refuses_damage_in_every_page_position",)),
    # -- read paths against the reference reader (issue 18; tests/test_reference_read.py)
    Mutation("a disk-cache page served without its CRC-32 check", "load/disk_cache.py",
             "if self.page_crcs is not None and crc32(data) != int(self.page_crcs[k]):",
             "if False and self.page_crcs is not None and crc32(data) != int(self.page_crcs[k]):",
             ("tests/test_reference_read.py::test_damaged_cache_pages_are_never_served",)),
    Mutation("a URL gather repeats a record's first page for the pages it crosses into", "load/remote_pages.py",
             "k, start = divmod(rel, ps)",
             "k, start = (int(offs[j]) - self.data_offset) // ps, rel % ps",
             ("tests/test_reference_read.py::test_remote_loader_equals_the_reference_with_and_without_cache_dir[http]",)),
    Mutation("ds[i] over a URL repeats a record's first page", "read/file_access.py",
             "pages = [have[k] for k in range(k0, k1)]",
             "pages = [have[k0] for k in range(k0, k1)]",
             ("tests/test_reference_read.py::test_remote_dataset_reads_equal_the_reference[http]",)),
    Mutation("process page cache copies a two-page record out of one slot", "load/pages.py",
             "cached = (np.maximum(rel + lens - 1, rel) // self.page_size) == first  # inside one page",
             "cached = (np.maximum(rel + lens - 1, rel) // self.page_size) <= first + 1  # inside one page",
             ("tests/test_reference_read.py::test_loader_batches_equal_the_reference[images.pageset-process-False]",)),
    Mutation("a restart-interval crop is cut with no upsampling context", "ops/jpeg_restart.py",
             "CONTEXT = 4",
             "CONTEXT = 0",
             ("tests/test_jpeg_restart.py::test_every_crop_equals_pillows_full_decode_then_crop",)),
    Mutation("RSTn numbers are not checked", "ops/jpeg_restart.py",
             "if m != 0xD0 + (k & 7) or k + 1 >= count:",
             "if k + 1 >= count:",
             ("tests/test_jpeg_restart.py::test_damaged_restart_markers_are_an_error_never_other_pixels",)),
]

# mixture weight schedules (formats/mixture.md section 3): each compared with the reference model or hand values
TS = "tests/test_schedules.py"
MUTATIONS += [
    Mutation("ramp blocks forget what each source already got (no carried remainder)", "order/schedule.py",
             "got = [c + k * v for c, v in zip(got, n)]",
             "got = [c + 0 * v for c, v in zip(got, n)]",
             (f"{TS}::test_ramp_tracks_the_integral_of_its_shares",)),
    Mutation("a ramp interpolates towards the previous stage (the quadratic term's sign flipped)", "order/schedule.py",
             "quad = [a2 * d - a * d2 for a, a2 in zip(q, q2)]",
             "quad = [a * d2 - a2 * d for a, a2 in zip(q, q2)]",
             (f"{TS}::test_stream_schedule_equals_the_model_on_random_schedules",)),
    Mutation("a step stage's tail takes the stage's whole quotas", "order/schedule.py",
             "tail = apportion(r, q)",
             "tail = list(q)",
             (f"{TS}::test_golden_vectors_of_formats_mixture_md",
              f"{TS}::test_all_gathered_stream_of_1_2_4_ranks_is_the_models[random]")),
    Mutation("edited weights restart every source from the new schedule's own counts", "order/schedule.py",
             "self.offset = counts - self.natural_counts(g0)",
             "self.offset = 0 * counts",
             (f"{TS}::test_edited_weights_at_resume_continue_as_the_model_says[constant]",)),
    Mutation("the mixture kernel drops a piece's base counts", "order/mixture.py",
             "k = base[s] + (g // period) * q[s] + rank[r]",
             "k = (g // period) * q[s] + rank[r]",
             (f"{TS}::test_all_gathered_stream_of_1_2_4_ranks_is_the_models[quasi_random]",)),
    Mutation("the schedule id leaves out the ramp block (another block resumes as the same schedule)",
             "order/schedule.py",
             'text = json.dumps({"block": self.block, "interpolate"',
             'text = json.dumps({"block": None, "interpolate"',
             (f"{TS}::test_golden_vectors_of_formats_mixture_md",)),
]

# image-text pairs (issue 32): captions padded as transformers' tokenizer pads them, ids read as the spec stores them
TI = "tests/test_image_text.py"
MUTATIONS += [
    Mutation("a truncated caption keeps the id before its last instead of its last", "ops/token_ids.py",
             "src = c - 1",
             "src = c - 2",
             (f"{TI}::test_captions_equal_the_transformers_tokenizer[1]",)),
    Mutation("a uint32 caption id loses its top byte", "ops/token_ids.py",
             "lo | (np.int64(buf[p + 2]) << 16) | (np.int64(buf[p + 3]) << 24)",
             "lo | (np.int64(buf[p + 2]) << 16)",
             (f"{TI}::test_token_ids_bad_values_name_the_sample_and_field",)),
]

# vision-language conversations (issue 32): placeholders expanded and labelled as LlavaProcessor and
# apply_chat_template give them, each image of a record cropped with its own key
TV = "tests/test_vlm.py"
MUTATIONS += [
    Mutation("image tokens are trained on (labelled with their id, not -100)", "ops/token_ids.py",
             "labels[pos] = -100",
             "labels[pos] = v",
             (f"{TV}::test_expanded_ids_and_labels_equal_llava_processor[1]",)),
    Mutation("a conversation's loss mask read one byte late", "ops/token_ids.py",
             "mbase = base + c * itemsize",
             "mbase = base + c * itemsize + 1",
             (f"{TV}::test_expanded_ids_and_labels_equal_llava_processor[1]",)),
    Mutation("every image of a record cropped with the sample's key", "ops/image_lists.py",
             "out[i] = keys[j] if k == 0 else splitmix64(keys[j] ^ (numba.uint64(k) * numba.uint64(GOLDEN)))",
             "out[i] = keys[j]",
             (f"{TV}::test_random_crops_key_each_image_of_a_record",)),
    Mutation("an image list's second image read from the first one's bytes", "ops/image_lists.py",
             "at += length",
             "at += 0",
             (f"{TV}::test_pixel_values_are_the_processors_within_the_stated_psnr[exact]",)),
    # packed conversations (formats/packing.md section 8)
    Mutation("a packed record's first token is a target of the record before it", "ops/token_ids.py",
             "out_labels[r, start] = -100",
             "out_labels[r, start] = out_labels[r, start]",
             (f"{TV}::test_kernels_on_hand_checked_values",)),  # a chat's first token is untrained anyway
    Mutation("a packed row's records in placement order, not by id", "ops/packing.py",
             "by_row = np.lexsort((perm, bin_of))",
             "by_row = np.argsort(bin_of, kind='stable')",
             (f"{TV}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[None]",)),
    Mutation("a packed row's images all start at its first slot", "load/stages.py",
             "+ (ends - counts) - (ends - counts)[row_start]",
             "+ 0 * row_start",
             (f"{TV}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[None]",)),
    Mutation("a packed row's span is its first record's (verify_pages misses the others' pages)",
             "load/packed.py",
             "lo, hi = _row_extent(counts, self._rec_off[recs], self._rec_off[recs] + self._rec_len[recs])",
             "first = recs[np.cumsum(counts) - counts]; lo, hi = self._rec_off[first], self._rec_off[first] + "
             "self._rec_len[first]",
             (f"{TV}::test_packed_rows_verify_every_page_of_their_records",)),
    Mutation("packing weighs a record without its image tokens", "load/packed.py",
             "weights += self.expected * (self.expand.tokens_per_image - 1)",
             "weights += 0",
             (f"{TV}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[None]",)),
]

# dynamic resolution (issue 32, Qwen2-VL): smart_resize, the patch layout and the per-image token counts as
# transformers' Qwen2VLProcessor gives them
TQ = "tests/test_vlm_dynamic.py"
TQ_IDS = f"{TQ}::test_ids_labels_grids_and_pixels_equal_qwen2vl_processor[defaults-exact]"
MUTATIONS += [
    Mutation("smart_resize rounds halves up, not to even as Python's round", "ops/patches.py",
             "h_bar = int(np.rint(height / factor)) * factor",
             "h_bar = int(np.floor(height / factor + 0.5)) * factor",
             (f"{TQ}::test_smart_resize_and_patch_layout_equal_transformers",)),
    Mutation("a merged token's patches taken column-first", "ops/patches.py",
             "y0 = (bh * merge + mh) * patch",
             "y0 = (bh * merge + mw) * patch",
             (f"{TQ}::test_smart_resize_and_patch_layout_equal_transformers",)),
    Mutation("an image's tokens counted per patch, not per merged patch group", "ops/patches.py",
             "tokens[i] = grid_h[i] * grid_w[i] // (merge * merge)",
             "tokens[i] = grid_h[i] * grid_w[i] // merge",
             (TQ_IDS,)),
    Mutation("every placeholder of a record takes its first image's token count", "ops/token_ids.py",
             "            k += 1\n",
             "            k += 0\n",
             (TQ_IDS,)),
    Mutation("each image's patches written from its row's first patch", "load/patches.py",
             "firsts = image_start - image_start[row_start[rows]]",
             "firsts = image_start - image_start",
             (TQ_IDS,)),
    Mutation("patches past a row's images keep what the slot held before", "load/patches.py",
             "                out[j, totals[j] : held[j]] = 0",
             "                pass",
             (f"{TQ}::test_patches_and_grids_past_a_rows_images_are_zero_when_buffers_are_reused",)),
    Mutation("packing weighs a dynamic-resolution record without its image tokens", "load/packed.py",
             "self._pack(self.counts + stage.record_image_tokens() - self.expected)",
             "self._pack(self.counts)",
             (f"{TQ}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[small-None]",)),
    Mutation("a packed row's image tokens read from the file's first images", "load/patches.py",
             "tokens[np.repeat(first[records] - starts, counts) + np.arange(int(counts.sum()))]",
             "tokens[np.arange(int(counts.sum()))]",
             (f"{TQ}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[small-None]",)),
    Mutation("a Mixture member without images leaves its placeholders unchecked", "load/stages.py",
             "self.expected = np.zeros(len(self.counts), dtype=np.int64)",
             "self.expected = np.full(len(self.counts), -1, dtype=np.int64)",
             (f"{TQ}::test_a_mixture_with_text_only_conversations[defaults]",)),
    Mutation("a packed row's dynamic-resolution images all in its first conversation", "load/patches.py",
             "np.repeat(position, counts))",
             "np.repeat(0 * position, counts))",
             (f"{TQ}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[small-None]",)),
    Mutation("a packed row's fixed-size images all in its first conversation", "load/stages.py",
             "np.repeat(np.arange(records.shape[0]) - row_start, counts)",
             "np.repeat(0 * row_start, counts)",
             (f"{TV}::test_packed_rows_equal_the_reference_packing_and_transformers_flattening[None]",)),
    Mutation("an image's grid height and width swapped", "load/patches.py",
             "grid[rows, slot, 1] = gh",
             "grid[rows, slot, 1] = gw",
             (TQ_IDS,)),
]


# LLaVA-format data (issue 32): roles and image order as LLaVA's files give them
TL_SRC = "tests/test_llava_source.py::test_entries_are_written_as_the_chat_template_and_the_photos"
MUTATIONS += [
    Mutation("LLaVA's gpt turns written as user turns", "write/llava.py",
             '"gpt": "assistant", "assistant"',
             '"gpt": "user", "assistant"',
             (TL_SRC,)),
    Mutation("an entry's images taken in reverse order", "write/llava.py",
             "images = [self._image(item, where) for item in items]",
             "images = [self._image(item, where) for item in items[::-1]]",
             (TL_SRC,)),
]


def _ids():
    return [m.name for m in MUTATIONS]


def test_every_mutation_applies():
    """Each pattern is found exactly once in today's source (else the list must follow the refactor)."""
    for m in MUTATIONS:
        text = (SRC / m.file).read_text()
        assert text.count(m.old) == 1, f"{m.name}: {m.old!r} found {text.count(m.old)} times in {m.file}"
        assert m.old != m.new
        for node in m.tests:
            assert (ROOT / node.split("::")[0]).is_file(), node
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS) >= 20


@functools.cache
def _imports() -> dict[str, set[str]]:
    """Module (path relative to src/pageset, e.g. "ops/tokens.py") -> the package modules it imports."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        package = list(rel.parent.parts)
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("pageset")):
                if node.level:  # from .x import y / from ..ops import x
                    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                    target = [*base, *(node.module.split(".") if node.module else [])]
                else:  # from pageset.ops.resize import f / from pageset.ops import jpeg_scale
                    target = node.module.split(".")[1:]
                names = [target + [a.name] for a in node.names] + [target]
            elif isinstance(node, ast.Import):  # import pageset.ops.x
                names = [a.name.split(".")[1:] for a in node.names if a.name.startswith("pageset.")]
            else:
                names = []
            if names:
                for parts in names:
                    if not parts:
                        continue
                    for cand in (Path(*parts).with_suffix(".py"), Path(*parts) / "__init__.py"):
                        if (SRC / cand).is_file():
                            deps.add(cand.as_posix())
        out[rel.as_posix()] = deps
    return out


def _affected(mutated: str) -> set[str]:
    """The mutated module and every module importing it, directly or not: their compiled kernels may hold the
    mutated code (Numba compiles a kernel's callees into it, and its cache tracks only the kernel's own file)."""
    deps, hit = _imports(), {mutated}
    while True:
        more = {mod for mod, imported in deps.items() if imported & hit} - hit
        if not more:
            return hit
        hit |= more


def _copy_ignore(m: Mutation):
    """copytree ignore: Python bytecode always; Numba's cache files (index .nbi, data .nbc) of the modules the
    mutation affects. The others' cache files are kept: a copy has the sources' mtimes and sizes (the cache's
    validity stamp), so the mutant's tests load those kernels instead of compiling them again (most of a
    mutant's time on a loaded machine)."""
    affected = {(str(Path(mod).parent), Path(mod).stem) for mod in _affected(m.file)}

    def ignore(folder, names):
        rel = Path(folder).relative_to(SRC)
        if rel.name != "__pycache__":
            return [n for n in names if n == "__pycache__" and not (Path(folder) / n).is_dir()]
        package = str(rel.parent)
        return [n for n in names if not n.endswith((".nbi", ".nbc")) or (package, n.split(".")[0]) in affected]

    return ignore


def _mutated_copy(m: Mutation, root: Path) -> Path:
    dest = root / "src"
    shutil.copytree(SRC, dest / "pageset", ignore=_copy_ignore(m))
    target = dest / "pageset" / m.file
    text = target.read_text()
    assert text.count(m.old) == 1, m.name
    target.write_text(text.replace(m.old, m.new))
    return dest


def _run_against(m: Mutation, root: Path) -> tuple[int, str]:
    src = _mutated_copy(m, root)
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("NUMBA_DISABLE_JIT", None)
    env.pop("NUMBA_CACHE_DIR", None)  # the copy's own __pycache__ holds the kept kernels (see _copy_ignore)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-W", "ignore::RuntimeWarning", *m.tests]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {exc.timeout} s"
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.slow
def test_curated_mutations_are_killed(tmp_path):
    """Every mutation makes its named tests fail (pytest exit code 1: tests ran and failed; 2-5 would be an
    interrupted run, a usage error or no tests collected, which prove nothing)."""
    _imports()  # build the import graph once, here: ast.parse in two threads at once fails on CPython 3.11
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {m.name: pool.submit(_run_against, m, tmp_path / f"m{k}") for k, m in enumerate(MUTATIONS)}
        results = {name: f.result() for name, f in futures.items()}
    survivors = {name: out for name, (rc, out) in results.items() if rc != 1}
    assert not survivors, "\n\n".join(f"SURVIVED: {name}\n{out}" for name, out in survivors.items())


def test_a_copy_on_pythonpath_is_what_the_tests_import(tmp_path):
    """The harness's premise: with PYTHONPATH pointing at a copy, ``import pageset`` loads the copy (not the
    editable install), in the subprocess and in the tests' conftest."""
    src = _mutated_copy(MUTATIONS[0], tmp_path)
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run([sys.executable, "-c", "import pageset, pageset.load.stages as s; print(s.__file__)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True).stdout
    assert Path(out.strip()) == src / "pageset" / "load" / "stages.py"
    assert MUTATIONS[0].new in Path(out.strip()).read_text()


# -- order against the reference model (issue 18, ref-order3): caught by tests/test_reference_order.py, which
# compares with tests/reference/order.py (written from formats/order.md and formats/mixture.md), not with another run
RO = "tests/test_reference_order.py"
MUTATIONS += [
    Mutation("a subset's state digest over its sorted ids (a reordered subset accepts the state)", "order/subset.py",
             'arr = np.ascontiguousarray(indices, dtype="<i8")',
             'arr = np.sort(np.ascontiguousarray(indices, dtype="<i8"))',
             (f"{RO}::test_subset_streams_resume_and_reordered_ids_equal_the_model[random]",)),
    Mutation("a mixture source skips its first sample (per-source rank counted from 1)", "order/quotas.py",
             "rank[t - 1] = counts[best]\n",
             "rank[t - 1] = counts[best] + 1\n",
             (f"{RO}::test_mixture_streams_and_resume_equal_the_model[quasi_random-False]",)),
    Mutation("a mixture state's per-source cursors one sample ahead", "order/mixture.py",
             "return [divmod(int(c), n) if n else (0, 0) for c, n",
             "return [divmod(int(c) + 1, n) if n else (0, 0) for c, n",
             (f"{RO}::test_mixture_streams_and_resume_equal_the_model[random-True]",)),
]

# -- plans (issue 19, plan19): caught by tests/test_plans.py, which compares every plan with tests/reference/order.py
TP = "tests/test_plans.py"
MUTATIONS += [
    Mutation("a many-file set maps a member's first record to the member before it", "order/fileset.py",
             'member = np.searchsorted(self.starts, gids, side="right") - 1',
             'member = np.searchsorted(self.starts, gids, side="left") - 1',
             (f"{TP}::test_many_file_plan_is_the_order_of_the_concatenated_page_list[random-True]",)),
    Mutation("padding starts one position after N", "order/plan.py",
             "else np.arange(start, stop, dtype=np.int64) >= self.n)",
             "else np.arange(start, stop, dtype=np.int64) > self.n)",
             (f"{TP}::test_file_plan_equals_the_reference[random-False]",)),
]

# -- batch-size changes on resume (issue 21, batch21): caught by tests/test_batch_change.py, which compares the Loaders'
# streams and states with tests/reference/order.py (formats/order.md section 5.1)
BC = "tests/test_batch_change.py"
MUTATIONS += [
    Mutation("a resumed epoch's steps snap to the new G's grid (positions repeated and skipped)", "load/epoch.py",
             "self._base = base = self._cursor % G", "self._base = base = 0",
             (f"{BC}::test_a_state_from_before_the_change_still_loads",)),
    Mutation("a resume from another global batch starts one position late", "order/state.py",
             "    return epoch, cursor, 0\n\n\ndef resume_point", "    return epoch, cursor + 1, 0\n\n\ndef resume_point",
             (f"{BC}::test_the_epoch_end_rule_by_hand",)),
    Mutation("drop_last=True keeps the short tail of a cut epoch", "order/sharding.py",
             "steps = (n - c) // g if drop_last else", "steps = -(-(n - c) // g) if drop_last else",
             (f"{BC}::test_the_epoch_end_rule_by_hand",)),
    Mutation("a mixture resumed with another G restarts its epochs at epoch * L (a gap or an overlap)",
             "order/mixture.py", "return epoch, cursor, origin + passed - epoch * self.epoch_length",
             "return epoch, cursor, 0", (f"{BC}::test_a_ramp_of_three_loaders[mixture]",)),
    Mutation("an inline (token) epoch cut by a change ends at L in the mixture stream", "load/epoch.py",
             "self._next_epoch(base + steps * G)", "self._next_epoch(self.epoch_length)",
             (f"{BC}::test_a_ramp_of_three_loaders[token_mixture]",)),
]
MF = "tests/test_manyfile_loader.py"
MUTATIONS += [  # a many-file set read flat (load/set_records.py)
    Mutation("a flat set reads every member's bytes from the first member's file", "ops/spans.py",
             "        i = run_v[j] >> shift\n        touched[i] = 1\n",
             "        i = (run_v[j] >> shift) * 0\n        touched[i] = 1\n",
             ("tests/test_reference_read.py::test_a_many_file_set_loads_like_the_reference_of_its_records"
              "[random-records-os-False]",)),
    Mutation("a flat set's offsets lose their member (every record read from member 0)", "load/set_records.py",
             'glob[lo:hi] = col + (k << MEMBER_SHIFT) if attr == "offs" else col',
             'glob[lo:hi] = col if attr == "offs" else col',
             (f"{MF}::test_a_set_loads_its_records_in_the_order_of_the_concatenated_pages[random-True]",)),
    Mutation("a flat token set reads windows from byte 0 of each member (its header)", "load/set_records.py",
             "self._bases[k] = src.stages[0].data_offset", "self._bases[k] = 0",
             (f"{MF}::test_a_token_set_reads_each_members_windows",)),
    Mutation("a flat set never checks the members it read", "ops/spans.py",
             "        if bad < 0 and file_changed(fds[i], sizes[i], mtimes[i], buf):\n",
             "        if False:\n",
             (f"{MF}::test_a_member_changed_after_it_was_read_is_named_when_read_again[8-True-touched]",)),
    Mutation("a flat set never checks the members it read (os.fstat path)", "load/set_records.py",
             "        touched[ks] = 0\n        self.check(ks)\n", "        touched[ks] = 0\n",
             (f"{MF}::test_a_member_changed_after_it_was_read_is_named_when_read_again[8-False-touched]",)),
    Mutation("records packed in file order are found at their batch-order offsets", "load/pages.py",
             "        out_offs[order] = starts\n", "        out_offs[:] = starts\n",
             ("tests/test_reference_read.py::test_loader_batches_equal_the_reference[records.pageset-os-False]",)),
    Mutation("a flat token set never checks the members it read", "ops/tokens.py",
             "        if bad < 0 and file_changed(fds[i], sizes[i], mtimes[i], buf):\n",
             "        if False:\n",
             (f"{MF}::test_a_token_member_changed_after_it_was_read_is_named_before_its_windows[8-True-touched]",)),
]


# -- mutmut survivors of issue 18's last item (mut18c) that change a written file with no error: each is caught by
# a test that compares with a hand-derived expectation (formats/v1.md metadata, the merge docstring's rules)
TM = "tests/test_merge.py"
MUTATIONS += [
    Mutation("merge keeps the first input's ignored_files count instead of the sum", "merge.py",
             'attrs["ignored_files"] = sum(int(ds.schema["attributes"].get("ignored_files", 0)) for ds in opened)',
             'attrs["ignored_files"] = int(opened[0].schema["attributes"].get("ignored_files", 0))',
             (f"{TM}::test_merge_sums_ignored_files_and_keeps_user_metadata_only_when_inputs_agree",)),
    Mutation("merge keeps the first input's user metadata when the inputs differ", "merge.py",
             "metadata = users[0] if all(u == users[0] for u in users) else {}",
             "metadata = users[0]",
             (f"{TM}::test_merge_sums_ignored_files_and_keeps_user_metadata_only_when_inputs_agree",)),
    Mutation("merge drops the caller's user metadata", "merge.py",
             'metadata = check.mapping("metadata", metadata, optional=True)',
             'metadata = check.mapping("metadata", None, optional=True)',
             (f"{TM}::test_merge_lineage_names_both_sources_and_shifts_skips_past_the_error_log",)),
    Mutation("merge names only the first input's source when the sources differ", "merge.py",
             'source = names[0] if all(n == names[0] for n in names) else " + ".join(names)',
             "source = names[0]",
             (f"{TM}::test_merge_lineage_names_both_sources_and_shifts_skips_past_the_error_log",)),
]

# -- issue 28: quasi-random windows sized in records (formats/order.md section 4.1): caught by tests that compare
# with the rule worked out by hand and with tests/reference/order.py
WM = "tests/test_window_mixing.py"
MUTATIONS += [
    Mutation("a window sized in records rounds its pages down (fewer records than window_records)",
             "order/shuffle.py", "return min(k, max(1, -(-(r * k) // n)))", "return min(k, max(1, (r * k) // n))",
             (f"{WM}::test_window_size_by_hand",)),
    Mutation("every mixture source takes the first source's window", "order/mixture.py",
             "                               self.window_pages[source])", "                               self.window_pages[0])",
             (f"{WM}::test_each_source_of_a_mixture_gets_its_own_window",)),
    Mutation("a subset's window sized on the file's pages, not the subset's", "order/subset.py",
             "super().__init__(self.layout.page_sizes, dataset_id, params, path)",
             "super().__init__(self.layout.page_sizes, dataset_id, params, path); "
             "self.window_pages = params.pages_per_window(sizes)",
             (f"{RO}::test_windows_sized_in_records_stream_state_and_resume_equal_the_model[subset-9]",)),
]

# -- issue 28: chat (items 3, 6a, 6b): chat files read packed, generation templates with other roles, the message
# rule on normalised turns, skipped conversations; each against transformers or the packing reference
TC = "tests/test_chat.py"
MUTATIONS += [
    Mutation("packed rows of a chat file ignore its loss mask", "load/packed.py",
             "else np.asarray(self.mask_bits, dtype=np.uint8))",
             "else np.zeros(0, np.uint8))",
             (f"{TC}::test_packed_rows_of_a_chat_file_follow_its_mask[1-random]",)),
    Mutation("a {% generation %} template with train_on user loses the user turns", "write/chat.py",
             'if m["role"] in self.train_on and not (self.has_generation and m["role"] == "assistant"):',
             'if m["role"] in self.train_on and not self.has_generation:',
             (f"{TC}::test_generation_template_trains_other_roles_by_the_message_rule",)),
    Mutation("the message rule leaves the end-of-turn token out", "write/chat.py",
             "return (at, at + max(content, len(turn))), None", "return (at, at + content), None",
             (f"{TC}::test_normalised_turns_hand_checked[llama3]",)),
    Mutation("skipped conversations numbered within their chunk", "write/tokens/encoding.py",
             "skipped.append((start + k, conv.where, str(exc)))", "skipped.append((k, conv.where, str(exc)))",
             (f"{TC}::test_on_error_skip_leaves_out_bad_conversations_naming_their_lines",)),
]

# -- issue 28: 6(c), 6(d), process mode, token weights (the seams where a set, a Mixture, the child process or a
# weight unit meets another feature): each passed the default run before the tests named here
TS, PM = "tests/test_token_sets.py", "tests/test_process_mode.py"
MUTATIONS += [
    Mutation("a flat token set's window row one token short (the last target read past the row)",
             "load/set_records.py", "scratch = ctx[self] = (np.empty(st.seq_len + 1, dtype=st.dtype),",
             "scratch = ctx[self] = (np.empty(st.seq_len, dtype=st.dtype),",
             (f"{TS}::test_a_token_set_gives_each_windows_input_target_and_document_outputs[uint16-flat-random]",)),
    Mutation("a flat token set's document outputs computed on the first rows of a Mixture's batch",
             "load/set_records.py", "        if st.docs:\n            st.fill_documents(arrays[0], lo, hi)",
             "        if st.docs:\n            st.fill_documents(arrays[0], 0, hi - lo)",
             (f"{TS}::test_a_token_set_in_a_mixture_gives_each_rows_outputs[uint16-flat]",)),
    Mutation("a set read member by member gives a Mixture's rows the first rows' augmentation keys",
             "load/set_source.py", "ids[sel] - self.starts[k], None if keys is None else keys[sel], ctx)",
             "ids[sel] - self.starts[k], None if keys is None else keys[: sel.shape[0]], ctx)",
             ("tests/test_image_set_mixture.py::test_a_set_in_an_image_mixture_gives_each_sample_its_own_crop_and_flip"
              "[process_cache]",)),
    Mutation("process mode: the augmentation keys never reach the child (every crop from a stale key)",
             "load/process_pool.py", '        if slot.keys is not None:\n            head["keys"][...] = slot.keys\n', "",
             (f"{PM}::test_batches_equal_pillow_and_stay_equal_while_held[the_last_batch]",)),
    Mutation("process mode: a shared slot refilled under a batch the user still holds", "load/ring.py",
             "slot.arrays = (self._shared.arrays(slot.index) if self._shared is not None else",
             "slot.arrays = (slot.arrays if self._shared is not None else",
             (f"{PM}::test_a_token_set_in_process_mode_gives_the_reference_windows[os]",)),
    Mutation("token weights divided from the rounded quotas, not the weights", "order/mixture.py",
             "weights.append(w * m.n_records / m.tokens)", "weights.append(Fraction(q) * m.n_records / m.tokens)",
             ("tests/test_mixtures.py::test_token_weights_follow_the_reference_model_on_ranks_and_after_resume"
              "[sequential-True-floats]",)),
    Mutation("a token set's predictions counted seq_len + 1 per window (token weights)", "load/set_source.py",
             "self.tokens = self.n_records * int(first.stages[0].seq_len) if self._token else None",
             "self.tokens = self.n_records * (int(first.stages[0].seq_len) + 1) if self._token else None",
             ("tests/test_mixtures.py::test_token_weights_of_stride_windows_follow_the_reference_model",)),
    Mutation("resize horizontally first when the width grows and the height shrinks (Pillow 13 goes vertical)",
             "ops/resize.py", "return src_h > out_h and (src_h - out_h) > (src_w - out_w) * 2",
             "return src_w >= out_w and src_h >= out_h and (src_h - out_h) > (src_w - out_w) * 2",
             ("tests/test_image_ops.py::test_resize_equals_pillow_when_the_width_grows_and_the_height_shrinks"
              "[chelsea]",)),
]


def test_kept_kernel_caches_skip_every_module_that_sees_the_mutation():
    """A mutant's copy keeps Numba's cache files only of modules that cannot hold the mutated code: never the
    mutated module's, nor those of modules importing it (relative or absolute, directly or not)."""
    assert {"ops/image_batch.py", "load/stages.py", "load/loader.py"} <= _affected("ops/resize.py")
    assert {"ops/image_batch.py", "ops/jpeg.py"} <= _affected("ops/jpeg_scale.py")
    assert "ops/tokens.py" not in _affected("ops/resize.py") and "order/shuffle.py" not in _affected("ops/resize.py")
    m = next(m for m in MUTATIONS if m.file == "ops/resize.py")
    names = ["resize.resize_crop_flip_normalize-1.py311.nbi", "resize.x-1.py311.0.nbc", "image_batch.y-1.py311.nbi",
             "tokens.z-1.py311.nbi", "resize.cpython-311.pyc"]
    assert sorted(_copy_ignore(m)(str(SRC / "ops" / "__pycache__"), names)) == sorted(
        ["resize.resize_crop_flip_normalize-1.py311.nbi", "resize.x-1.py311.0.nbc", "image_batch.y-1.py311.nbi",
         "resize.cpython-311.pyc"])
