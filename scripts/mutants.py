"""Plant each known fault in a copy of the repository and check that a fast test catches it.

``make mutants`` runs this. For every fault in :data:`FAULTS` it copies ``src/``, ``tests/``, ``scripts/``,
``pyproject.toml``, ``docs/`` and ``README.md`` to a temporary folder, applies the fault (exact text replacements in one file),
runs the few fast tests chosen to catch it with ``PYTHONPATH`` pointing at the copy, and prints a
table: fault, the first test that failed, seconds. It exits 1 when a fault survives (every chosen
test passed), when a run times out, when the chosen tests fail without any fault (the baseline), or
when a fault's text no longer occurs exactly once in its file, so the list cannot rot silently:
after a refactor, update the pattern to plant the same fault in the new code.

    python scripts/mutants.py            # every fault
    python scripts/mutants.py -k resume  # faults whose name contains "resume"
    python scripts/mutants.py --list     # the faults and their tests, without running anything
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNIT = "tests/unit/test_promises.py"
MAP = "tests/unit/test_map_known_answers.py"
DIST = "tests/distributed/test_promises_distributed.py"

RESUME_TESTS = (f"{DIST}::test_resume_in_one_process_equals_the_uninterrupted_run",
                f"{DIST}::test_resume_on_two_ranks_equals_the_uninterrupted_run")
PARITY_TEST = f"{DIST}::test_ddp_with_an_idle_rank_in_the_last_step_equals_one_process"
PREDICT = "tests/e2e/test_predict.py"
TASKS = "tests/unit/test_task_predictions.py"
RANGES = "tests/unit/test_config_ranges.py"
DOWNLOAD = "tests/e2e/test_download.py"
REPORT = "tests/unit/test_report.py"
UNITS = "tests/unit/test_units.py"
CHECKLIST = "tests/unit/test_gpu_checklist.py"
UINT8 = "tests/unit/test_device_normalize_tasks.py"
F16 = "tests/unit/test_float16_skips.py"


@dataclass(frozen=True)
class Fault:
    """One planted fault: exact replacements in one file, and the fast tests that must catch it."""

    name: str
    file: str
    replacements: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    """pytest node ids, cheapest first (the run stops at the first failure)."""


FAULTS: tuple[Fault, ...] = (
    # -- issue 10's table --------------------------------------------------------------------
    Fault("eval sampler pads like DistributedSampler", "src/gputrain/strategies/base.py",
          (("return EvalSampler(length, rank=self.dp_rank, world_size=self.dp_size)",
            "return torch.utils.data.DistributedSampler(range(length), num_replicas=self.dp_size, "
            "rank=self.dp_rank, shuffle=False)"),),
          (f"{DIST}::test_ddp_evaluation_counts_every_sample_once",)),
    Fault("DDP syncs gradients on every micro-batch", "src/gputrain/strategies/ddp.py",
          (("module.require_backward_grad_sync = enabled", "module.require_backward_grad_sync = True"),),
          (f"{DIST}::test_accumulation_all_reduces_gradients_once_per_step",)),
    Fault('RNG state not restored on resume', 'src/gputrain/checkpoint/state.py',
          (('set_rng_state(rng[str(parts.dist.rank)])',
            'pass'), ),
          RESUME_TESTS),
    Fault('scheduler state not restored on resume', 'src/gputrain/checkpoint/state.py',
          (('parts.scheduler.load_state_dict(state["scheduler"])',
            'pass'), ),
          RESUME_TESTS),
    Fault('GradScaler state not restored on resume', 'src/gputrain/checkpoint/state.py',
          (('parts.precision.load_state_dict(state.get("precision", {}))',
            'pass'), ),
          RESUME_TESTS),
    Fault('SyncBatchNorm conversion dropped', 'src/gputrain/engine/setup.py',
          (('model = convert_sync_batchnorm(model, dist.device.type)',
            'model = model'), ),
          (f"{DIST}::test_sync_batchnorm_gives_the_running_stats_of_global_batchnorm",)),
    Fault("mAP box conversion off by one pixel", "src/gputrain/metrics/detection.py",
          (("boxes[:, 2:] - boxes[:, :2]], dim=1)", "boxes[:, 2:] - boxes[:, :2] + 1], dim=1)"),),
          (MAP,)),
    Fault("no checkpoint written", "src/gputrain/engine/defaults.py",
          (("hooks.append(CheckpointHook(t.checkpoint_every_n_epochs))", "pass"),),
          (f"{UNIT}::test_checkpoints_are_written_with_the_expected_names",)),
    # -- the three guarantees issue 10 fixed ----------------------------------------------------
    Fault("no buffer sync before evaluation (DDP)", "src/gputrain/strategies/ddp.py",
          (("dist.broadcast(buffer, src=0)", "pass"),),
          (f"{DIST}::test_ddp_validation_equals_evaluating_the_saved_checkpoint_in_one_process",)),
    Fault('non-finite check removed from save_checkpoint', 'src/gputrain/checkpoint/checkpointer.py',
          (('if not (all_finite(parts, loss) if not in_background else loss is None or math.isfinite(loss)):',
            'if False:'), ),
          (f"{UNIT}::test_divergence_inside_an_epoch_stops_a_synchronous_save_before_it_writes",)),
    Fault('the background writer writes a non-finite copy', 'src/gputrain/checkpoint/snapshot.py',
          (('if check_finite and not tensors_finite(',
            'if False and not tensors_finite('), ),
          (f"{UNIT}::test_divergence_inside_an_epoch_writes_nothing_non_finite",)),
    Fault('non-finite weights check removed from the epoch end', 'src/gputrain/engine/epoch.py',
          (('if not math.isfinite(epoch_loss) and window.epoch_skipped < window.epoch_samples or not loop.all_finite():',
            'if not math.isfinite(epoch_loss) and window.epoch_skipped < window.epoch_samples:'), ),
          (f"{UNIT}::test_divergence_without_checkpointing_still_fails",)),
    Fault("checkpoint files mode 0600", "src/gputrain/checkpoint/files.py",
          (('getattr(os, "O_CLOEXEC", 0), 0o666)', 'getattr(os, "O_CLOEXEC", 0), 0o600)'),),
          (f"{UNIT}::test_checkpoints_are_written_with_the_expected_names",)),
    Fault("rank 0's failed checkpoint write raised on rank 0 alone", 'src/gputrain/checkpoint/checkpointer.py',
          (('        _agree_on_the_write(self.dist, failed)\n        return path',
            '        if failed is not None:\n            raise failed\n        comm.barrier()\n        return path'), ),
          ("tests/distributed/test_checkpoint_agreement.py::"
           "test_a_checkpoint_rank_0_could_not_write_stops_every_rank_with_its_line",)),
    Fault("check_plain names another place of the refused entry", "src/gputrain/checkpoint/files.py",
          (('            stack.extend((v, f"{path}[{k!r}]") for k, v in item.items())',
            '            stack.extend((v, f"{path}[{k!r}]") for k, v in reversed(item.items()))'),),
          ("tests/unit/test_checkpoint_store.py::test_an_object_refused_twice_is_named_where_the_check_met_it",)),
    Fault("a lost rendezvous reaches the user as torchrun's traceback", "src/gputrain/launcher/ranks.py",
          (("        except RendezvousError as err:", "        except ImportError as err:"),),
          ("tests/unit/test_rendezvous_errors.py::test_a_lost_rendezvous_ends_in_one_line_naming_the_node_and_endpoint",)),
    Fault('stale checkpoint temporaries kept', 'src/gputrain/checkpoint/checkpointer.py',
          (('            remove_stale_temporaries(folder)',
            '            pass'), ),
          (f"{UNIT}::test_a_killed_save_leaves_no_temporary_after_the_next_start",)),
    # -- promises added since ----------------------------------------------------------------
    Fault("gradients summed over ranks (loss weight x dp)", "src/gputrain/engine/epoch.py",
          (("weight=n * dp / n_step", "weight=n * dp * dp / n_step"),), (PARITY_TEST,)),
    Fault("hand-averaged gradients summed (no division)", "src/gputrain/strategies/base.py",
          (("flat /= self.dp_size", "flat /= 1"),), (PARITY_TEST,)),
    Fault('optimizer state not restored on resume', 'src/gputrain/checkpoint/state.py',
          (('parts.strategy.load_optimizer_state_dict(parts.module, parts.optimizer, state["optimizer"])',
            'pass'), ),
          RESUME_TESTS),
    Fault("unsynced replicas (DDP replaced by the bare module)", "src/gputrain/strategies/ddp.py",
          (("return DistributedDataParallel(", "return model; DistributedDataParallel("),), (PARITY_TEST,)),
    Fault("padded training order (last step filled with the epoch's head)", "src/gputrain/data/samplers.py",
          (("self.order = epoch_permutation(n, seed, epoch, shuffle)",
            "self.order = epoch_permutation(n, seed, epoch, shuffle)\n"
            "        self.order += self.order[:-n % (batch_size * dp_size * accumulate)]"),
           ("usable = (n // self.global_batch) * self.global_batch if drop_last else n",
            "usable = (n // self.global_batch) * self.global_batch if drop_last else len(self.order)")),
          (f"{UNIT}::test_training_reads_every_sample_once_per_epoch",)),
    # -- h17b: gputrain predict and pictures of a run (issue 17 items 4, 5) --------------------
    Fault("predict normalizes with other statistics than evaluation", "src/gputrain/tasks/classification.py",
          (("mean=mean, std=std), eval_preprocess(cfg)", "mean=mean, std=std), normalize_transform(CIFAR_MEAN, CIFAR_STD)"),),
          ("tests/e2e/test_predict.py::test_classification_csv_scores_as_eval",)),
    Fault("predicted masks not in ADE20K's k + 1 encoding", "src/gputrain/tasks/segmentation.py",
          (("PngEncoder((labels.to(torch.int16) + 1)", "PngEncoder((labels.to(torch.int16) + 0)"),),
          ("tests/e2e/test_predict.py::test_segmentation_masks_score_as_eval",)),
    Fault("predict keeps rank 0's share only", "src/gputrain/tools/predict/run.py",
          (("merged = {k: v for part in gathered for k, v in part.items()}", "merged = dict(gathered[0])"),),
          ("tests/e2e/test_predict.py::test_two_processes_write_the_same_files",)),
    Fault('predict writes into a non-empty --out', 'src/gputrain/tools/predict/command.py',
          (('        if not overwrite:\n            raise ValueError(f"--out {out} is not empty',
            '        if False:\n            raise ValueError(f"--out {out} is not empty'), ),
          ("tests/e2e/test_predict.py::test_refusals_are_one_line",)),
    Fault("curves count an epoch logged again after a resume twice", "src/gputrain/runs/pictures.py",
          (('by_epoch[int(r["epoch"])] = r', "by_epoch[len(by_epoch) + 1] = r"),),
          ("tests/unit/test_report.py::test_an_epoch_logged_again_after_a_resume_counts_once",)),
    Fault("TensorBoard never receives the sample grid", "src/gputrain/runs/loggers.py",
          (('self.writer.add_image(name, image, global_step=step, dataformats="HWC")', "pass"),),
          ("tests/unit/test_report.py::test_tensorboard_receives_the_sample_grid_at_each_evaluation",)),
    Fault("predicted detections keep model labels, not the annotation file's ids", 'src/gputrain/tasks/detection.py',
          (('detections_to_coco(output, image_id, self.label_to_category,',
            'detections_to_coco(output, image_id, None,'), ),
          ("tests/e2e/test_predict.py::test_detections_take_the_annotation_files_ids",)),
    # -- issue 16 item 4 (h16b): checkpoints written in a background thread ---------------------
    Fault('async checkpoint writer not awaited at the end of training', 'src/gputrain/engine/callbacks/checkpoint.py',
          (('ctx.wait_for_checkpoints()  # a failed last save',
            'pass  # a failed last save'), ),
          ("tests/unit/test_checkpoint_writer.py::test_fit_returns_with_every_checkpoint_on_disk",
           "tests/unit/test_checkpoint_writer.py::test_a_failed_last_save_fails_the_end_of_training_in_one_line")),
    Fault("async checkpoint state not copied before the step mutates it", "src/gputrain/checkpoint/snapshot.py",
          (("        return buffers[index[id(obj)]]\n", "        return obj\n"),),
          ("tests/unit/test_checkpoint_writer.py::test_the_step_cannot_change_a_checkpoint_being_written",)),
    Fault('async checkpoint saves overlap (the next does not wait, its error is lost)', 'src/gputrain/checkpoint/snapshot.py',
          (('        self.wait()\n        check_plain(state)',
            '        check_plain(state)'), ),
          ("tests/unit/test_checkpoint_writer.py::test_a_failed_background_save_fails_the_next_save_in_one_line",
           "tests/unit/test_checkpoint_writer.py::"
           "test_the_next_save_reuses_the_host_buffers_only_after_the_previous_one_is_on_disk")),
    Fault("the snapshot's host buffers allocated anew at every save", 'src/gputrain/checkpoint/snapshot.py',
          (('self._buffers = [old if i < len(previous) and _fits(',
            'self._buffers = [old if False and _fits('), ),
          ("tests/unit/test_checkpoint_writer.py::"
           "test_the_next_save_reuses_the_host_buffers_only_after_the_previous_one_is_on_disk",)),
    Fault("a view's shared buffer is allocated anew at every save", "src/gputrain/checkpoint/snapshot.py",
          (("    return buffer.stride() == source.stride() or buffer.stride() == torch.empty_like(",
            "    return buffer.stride() == source.stride() or False and buffer.stride() == torch.empty_like("),),
          ("tests/unit/test_checkpoint_writer.py::test_two_saves_of_one_layout_reuse_every_buffer_views_included",)),
    # -- issue 16: what a checkpoint written off the critical path checks --------------------------------
    Fault("the finiteness check takes an overflowing sum for a NaN", "src/gputrain/checkpoint/files.py",
          (("    return all(ok or bool(torch.isfinite(t).all()) for t, ok in zip(tensors, flags, strict=True))",
            "    return all(flags)"),),
          (f"{UNIT}::test_the_finiteness_check_finds_each_kind_of_non_finite_value_and_no_false_one",)),
    Fault('predict hands a channels-last model its batches as they come', 'src/gputrain/tools/predict/run.py',
          (('channels_last=loop.fast.channels_last)',
            'channels_last=False)'), ),
          ("tests/e2e/test_predict.py::test_predict_runs_the_model_in_the_layout_the_config_resolves",)),
    # -- issue 16 item 5: the CPU gap ---------------------------------------------------------------
    Fault('trainer.reuse_host_memory ignored', 'src/gputrain/engine/fast.py',
          (('        keep_freed_host_memory()\n',
            '        pass\n'), ),
          ("tests/unit/test_fast_path.py::test_reusing_host_memory_serves_large_blocks_from_the_heap_instead_of_fresh_mappings",)),
    Fault("auto leaves host memory reuse off", "src/gputrain/config/resolve.py",
          (("reuse_host_memory=_auto(t.reuse_host_memory, glibc())", "reuse_host_memory=_auto(t.reuse_host_memory, False)"),),
          ("tests/unit/test_fast_path.py::test_auto_turns_the_options_on_for_cuda_and_leaves_a_cpu_run_as_it_was",)),
    Fault("each rank stops on its own signal, not the agreed one (agreement every few steps)", "src/gputrain/dist/stop.py",
          (("        signum, slowest = int(agreed[0]), float(agreed[1])",
            "        signum, slowest = self.received, float(agreed[1])"),),
          ("tests/distributed/test_stop_agreement.py::test_fast_steps_agree_every_few_steps_at_the_same_calls_on_every_rank",
           "tests/e2e/test_faults.py::test_a_signal_to_one_worker_stops_every_rank_after_the_same_step")),
    Fault("the ranks agree on a stop at every step", "src/gputrain/dist/stop.py",
          (("        probe = self._calls == PROBE_STEPS and self.every == 1", "        probe = False"),),
          ("tests/distributed/test_stop_agreement.py::test_fast_steps_agree_every_few_steps_at_the_same_calls_on_every_rank",)),
    # -- issue 16 item 2 (h16b): data.num_workers=auto ------------------------------------------
    Fault("auto workers ignore the other processes of the node", "src/gputrain/config/resolve.py",
          (("cores // max(local_processes, 1)", "cores"),),
          ("tests/unit/test_data_workers.py::test_auto_divides_the_cores_among_the_local_processes",)),
    # -- issue 15 items 3, 4, 7, 9, 10 (task h15c) ---------------------------------------------
    Fault("h15c config ranges not checked", "src/gputrain/config/checks.py",
          (("    check_numbers(cfg)\n    check_combinations(cfg)", "    check_combinations(cfg)"),),
          ("tests/unit/test_config_ranges.py::test_lr_1e39_on_the_command_line_is_one_line_and_exit_2",)),
    Fault("h15c config range upper bounds ignored", "src/gputrain/config/checks.py",
          (("and (self.le is None or value <= self.le)", "and True"),),
          ("tests/unit/test_config_ranges.py",)),
    Fault("h15c recipe type error without its line", "src/gputrain/config/load.py",
          (("    return int(node.start_mark.line) + 1", "    return None"),),
          ("tests/unit/test_config_ranges.py::test_wrong_type_in_a_recipe_file_names_the_file_and_line",)),
    Fault("h15c another recipe's model options merged into a checkpoint", "src/gputrain/tools/from_checkpoint.py",
          (("        return load_config(None, overrides, layers=[_as_layer(saved)]), note",
            "        return load_config(recipe, overrides, layers=[{k: saved[k] for k in ('task', 'model', 'data')}]), "
            "note"),),
          ("tests/unit/test_run_folder.py::test_another_recipe_never_merges_its_model_options_into_a_checkpoint",)),
    Fault("h15c CLI parser imports torch", "src/gputrain/cli/parser.py",
          (("from gputrain.config import builtin_recipes\n", "import torch  # noqa: F401\n"
            "from gputrain.config import builtin_recipes\n"),),
          ("tests/e2e/test_cli_flags.py::test_help_version_and_usage_errors_answer_without_importing_torch",)),
    Fault("h15c parity lacks the common flags", "src/gputrain/cli/parser.py",
          (("    add_common_flags(p)\n    p.set_defaults(func=handlers[\"parity\"])",
            "    p.set_defaults(func=handlers[\"parity\"])"),),
          ("tests/e2e/test_cli_flags.py::test_every_recipe_command_takes_every_common_flag_as_its_config_field",)),
    Fault('h15c doctor starts ranks before checking data paths', 'src/gputrain/cli/commands.py',
          (('    _check_recipe(args)  # a missing data folder is one line here, not a hang or a failure on every rank\n    from gputrain.tools.diagnose.doctor',
            '    from gputrain.tools.diagnose.doctor'), ),
          ("tests/e2e/test_cli_flags.py::test_tools_honour_data_root_and_refuse_a_missing_one_before_any_rank",)),
    Fault("h15c bench scale rows get their own thread share", "src/gputrain/tools/bench/scale.py",
          (("    return max(1, cores // max(devices))", "    return cores"),
           ("    return cmd, {**os.environ, \"OMP_NUM_THREADS\": str(threads)}", "    return cmd, dict(os.environ)")),
          ("tests/unit/test_run_folder.py::test_bench_scale_gives_every_row_the_same_threads_per_process_and_states_them",)),
    Fault("h15c bench scale plot hides impossible points", "src/gputrain/tools/bench/scale.py",
          (("    odd = [r for r in rows if r.caution]", "    odd: list[ScaleRow] = []"),),
          ("tests/unit/test_run_folder.py::test_bench_scale_plot_marks_the_impossible_points_as_the_table_does",)),
    # -- issue 15, task h15a: split models, pipeline and FSDP arithmetic, non-finite validation -------------
    Fault("pipeline schedule averages chunk gradients too (scale_grads=True)", "src/gputrain/strategies/pipeline_model.py",
          (("scale_grads=False))", "scale_grads=True))"),),
          ("tests/distributed/test_pipeline.py::test_two_stages_match_single_on_a_short_batch_with_unequal_chunks",)),
    Fault("pipeline chunk loss not weighted by the chunk's share of the batch",
          "src/gputrain/strategies/pipeline_model.py",
          (("return loss * (size / ctx.n * ctx.weight)",
            "return loss * (ctx.weight / -(-ctx.n // self.options.micro_batch_size))"),),
          ("tests/distributed/test_pipeline.py::test_two_stages_match_single_on_a_short_batch_with_unequal_chunks",)),
    Fault("FSDP clips with the norm of this rank's shards only", "src/gputrain/strategies/fsdp.py",
          (("get_total_norm([p.grad for p in params if p.grad is not None])",
            "get_total_norm([p.grad.to_local() for p in params if p.grad is not None])"),),
          ("tests/distributed/test_fsdp.py::test_fsdp_clips_to_the_norm_over_all_shards",)),
    Fault("model_parallel trains a chain that is not the model's forward (check not called)",
          "src/gputrain/strategies/model_parallel.py",
          (("        verify_chain(self.model, self.blocks, example)\n", ""),),
          ("tests/distributed/test_model_parallel.py::test_a_skip_connection_is_refused_in_one_line_before_any_step",
           "tests/distributed/test_model_parallel.py::test_children_that_cannot_be_chained_get_one_line_not_a_shape_error")),
    Fault("pipeline trains a chain that is not the model's forward (check not called)",
          "src/gputrain/strategies/pipeline_model.py",
          (("                verify_chain(self.model, self.blocks, example)\n", ""),),
          ("tests/distributed/test_model_parallel.py::test_cli_refuses_a_user_model_that_is_not_its_chain[pipeline]",)),
    Fault('non-finite validation metric passes silently', 'src/gputrain/engine/evaluate.py',
          (('    warn_non_finite(metrics, epoch, is_main=loop.dist.is_main)\n',
            ''), ),
          ("tests/distributed/test_model_parallel.py::"
           "test_a_non_finite_validation_metric_prints_one_warning_naming_it_and_the_epoch",)),
    Fault("plan header printed twice, once empty (measured split)", "src/gputrain/strategies/model_parallel.py",
          (("            self._announce_wait()", "            self._announce_plan('')"),),
          ("tests/unit/test_model_parallel_placement.py::"
           "test_measured_split_waits_for_a_batch_then_rebinds_the_optimizer",)),
    # -- h15b: issue 15's table ------------------------------------------------------------------
    Fault("stop request not agreed across ranks", "src/gputrain/dist/stop.py",
          (("if self.world_size == 1 or not dist.is_initialized():\n            return self.received",
            "if True:\n            return self.received"),),
          ("tests/e2e/test_faults.py::test_a_signal_to_one_worker_stops_every_rank_after_the_same_step",)),
    Fault("segmentation validation loss weighted by all pixels (void included)", "src/gputrain/metrics/segmentation.py",
          (("self.loss.update(outputs, targets, loss, int(keep.sum()))",
            "self.loss.update(outputs, targets, loss, targets.numel())"),),
          (f"{UNIT}::test_segmentation_validation_loss_is_the_mean_over_labelled_pixels",)),
    Fault('lr scaled from the per-device batch, not the global batch', 'src/gputrain/engine/setup.py',
          (('lr = scaled_lr(o.lr, loop.global_batch, o.reference_batch, o.scale_lr)',
            'lr = scaled_lr(o.lr, t.batch_size, o.reference_batch, o.scale_lr)'), ),
          (f"{UNIT}::test_linear_lr_scaling_uses_the_global_batch_with_accumulation",)),
    Fault("augmentation seed ignores the epoch", "src/gputrain/data/samplers.py",
          (("manual_seed(((self.seed * 1_000_003 + epoch) * 2_147_483_647", "manual_seed(((self.seed * 1_000_003) * 2_147_483_647"),),
          (f"{UNIT}::test_augmentation_changes_from_epoch_to_epoch_and_repeats_within_one",)),
    Fault("gputrain.launch leaves the agent's noise and signal handlers to the caller", "src/gputrain/launcher/ranks.py",
          (("with _launcher_scope():  # quiet agent", "with contextlib.nullcontext():  # quiet agent"),),
          ("tests/distributed/test_launch.py::"
           "test_a_failing_rank_under_launch_is_one_exception_and_the_callers_handler_comes_back[elastic-agent]",)),
    # -- issue 17: pretrained weights --------------------------------------------------------
    Fault("pretrained weights fetched but never loaded", "src/gputrain/models/pretrained.py",
          (("    model.load_state_dict(fitting, strict=False)\n", "    pass\n"),),
          ("tests/e2e/test_pretrained.py::test_a_name_in_the_hub_cache_starts_from_exactly_those_tensors_with_a_new_head",)),
    Fault("pretrained head loaded over the new head's shape check", "src/gputrain/models/pretrained.py",
          (("if k in own and tuple(v.shape) == tuple(own[k].shape)}", "if k in own}"),),
          ("tests/e2e/test_pretrained.py::test_a_name_in_the_hub_cache_starts_from_exactly_those_tensors_with_a_new_head",)),
    Fault("weights downloaded without the hash check", "src/gputrain/models/pretrained.py",
          (("match.group(1) if match else None", "None"),),
          ("tests/e2e/test_pretrained.py::test_a_download_whose_hash_prefix_differs_is_refused_in_one_line",)),
    Fault("data.download skips the archive's md5", "src/gputrain/data/download.py",
          (("filename=filename, md5=md5)", "filename=filename, md5=None)"),),
          ("tests/e2e/test_download.py::test_a_checksum_mismatch_is_one_line_and_leaves_no_archive",)),
    Fault("data.download not run by the launcher", "src/gputrain/cli/preflight.py",
          (("    download_data(cfg)\n", "    pass\n"),),
          ("tests/e2e/test_download.py::test_two_processes_train_on_data_downloaded_once_per_node",)),
    Fault("frozen blocks keep training BatchNorm", "src/gputrain/models/finetune.py",
          (("        freeze_batchnorm(model, only=inside)  #", "        pass  #"),),
          ("tests/e2e/test_finetune.py::test_a_frozen_backbone_trains_only_the_head_and_keeps_its_statistics_in_train_mode",)),
    Fault("eval rebuilds a fine-tuned model without its frozen BatchNorm", "src/gputrain/tools/from_checkpoint.py",
          (("model = finetuned(build_model(cfg.model.name, **cfg.model.kwargs), cfg.model)",
            "model = build_model(cfg.model.name, **cfg.model.kwargs)"),),
          ("tests/e2e/test_finetune.py::test_fine_tuning_a_frozen_backbone_keeps_it_and_two_processes_equal_one",)),
    Fault("pretrained tensors trained at the head's learning rate", "src/gputrain/optim.py",
          (('"lr": cfg.lr * cfg.pretrained_lr_scale}', '"lr": cfg.lr}'),),
          ("tests/e2e/test_finetune.py::test_pretrained_tensors_get_their_own_learning_rate_and_the_head_keeps_lr",)),
    # -- issue 16 item 1: the speed options -------------------------------------------------------
    Fault("channels-last model but inputs left as they come", "src/gputrain/engine/fast.py",
          (("return inputs.contiguous(memory_format=torch.channels_last)", "return inputs"),),
          ("tests/unit/test_fast_path.py::test_channels_last_reaches_every_convolution_in_training_and_evaluation",)),
    Fault("channels-last inputs but the model left as it is", "src/gputrain/engine/fast.py",
          (("return model.to(memory_format=torch.channels_last)", "return model"),),
          ("tests/unit/test_fast_path.py::test_channels_last_reaches_every_convolution_in_training_and_evaluation",)),
    Fault('auto turns channels-last on for a CPU run', 'src/gputrain/config/resolve.py',
          (('channels_last=_auto(t.channels_last, cuda and facts.fixed_shapes)',
            'channels_last=_auto(t.channels_last, True)'), ),
          ("tests/unit/test_fast_path.py::test_auto_turns_the_options_on_for_cuda_and_leaves_a_cpu_run_as_it_was",)),
    Fault("optim.fused ignored", "src/gputrain/optim.py",
          (('{"fused": True} if cfg.fused is True else {}', "{}"),),
          ("tests/unit/test_fast_path.py::test_fused_optimizer_is_used_when_asked_and_trains_alike",)),
    Fault("options off still change the step (loss scaled by a rounding factor)", "src/gputrain/strategies/base.py",
          (("precision.backward(loss * micro.weight)", "precision.backward(loss * (micro.weight * (1 + 1e-7)))"),),
          ("tests/unit/test_fast_path.py::test_every_option_off_is_the_plain_pytorch_path_bit_for_bit",)),
    Fault('trainer.compile ignored by the loop', 'src/gputrain/engine/setup.py',
          (('        strategy.compile_module(loop.module, loop.fast.compile_mode)',
            '        pass'), ),
          ("tests/distributed/test_compile.py::test_compiled_training_ends_where_eager_training_ends",)),
    Fault("FSDP blocks not compiled", "src/gputrain/strategies/fsdp.py",
          (("unit.forward = torch.compile(unit.forward, mode=mode)  # type: ignore[method-assign]", "pass"),),
          ("tests/distributed/test_compile.py::test_compiled_ddp_fsdp_and_pipeline_on_two_ranks_end_where_eager_ends",)),
    Fault("split model's stages not compiled", "src/gputrain/strategies/model_parallel.py",
          (("                stage.compile(mode=self.compile_mode)", "                pass"),),
          ("tests/distributed/test_compile.py::test_each_stage_of_a_split_model_is_compiled_and_trains_as_eager",)),
    # -- issue 16 item 2: images decoded on the device ------------------------------------------------
    Fault("device-side augmentation ignores the sample's seed", "src/gputrain/data/device_decode.py",
          (("                torch.default_generator.manual_seed(image.seed)\n", ""),),
          ("tests/unit/test_device_decode.py::test_a_batch_decoded_on_the_device_equals_the_one_decoded_in_workers",)),
    Fault("encoded samples record the seed after drawing from it", "src/gputrain/data/device_decode.py",
          (("return EncodedImage(data, str(path), torch.initial_seed())",
            "return EncodedImage(data, str(path), int(torch.randint(2**31, ())))"),),
          ("tests/unit/test_device_decode.py::test_a_batch_decoded_on_the_device_equals_the_one_decoded_in_workers",)),
    Fault("a corrupt image decoded on the device is not named", "src/gputrain/data/device_decode.py",
          (("    return decode_rgb(image.data, image.path).to(device)", "    return decode_rgb(image.data, \"an image\").to(device)"),),
          ("tests/unit/test_device_decode.py::test_a_corrupt_jpeg_is_one_line_naming_the_file",)),
    # -- issue 16 item 4: one CRC pass (torch's zip records), bound to the manifest ------------------------
    Fault("the records' bytes are not checked against their CRCs", "src/gputrain/checkpoint/manifest.py",
          (("                    bad = archive.testzip()", "                    bad = None"),),
          ("tests/unit/test_checkpoint_store.py::test_bit_flip_that_torch_load_accepts_is_caught",)),
    Fault("any intact zip passes for the manifest's file", "src/gputrain/checkpoint/manifest.py",
          (("if any(e[\"zip_crc32\"] == records for e in zipped):", "if zipped:"),),
          ("tests/unit/test_checkpoint_store.py::test_a_valid_checkpoint_of_the_same_size_is_not_the_one_listed",)),
    Fault("with torch's record CRCs off nothing checks the bytes", 'src/gputrain/checkpoint/files.py',
          (('crc=not torch_writes_record_crcs()',
            'crc=False'), ),
          ("tests/unit/test_checkpoint_store.py::test_with_torchs_record_crcs_off_the_whole_file_is_checksummed",)),
    # -- issue 16 item 2: uint8 batches normalized on the device --------------------------------------------
    Fault("the device scales uint8 pixels by its own arithmetic", "src/gputrain/data/device_normalize.py",
          (("return normalize_transform(mean, std)  # type: ignore[return-value]",
            "return lambda x: (x.float() / 255 - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)"),),
          ("tests/unit/test_device_normalize.py::test_a_batch_normalized_on_the_device_equals_the_one_normalized_in_workers",
           f"{UINT8}::test_segmentation_images_made_float_on_the_device_equal_the_workers_and_masks_are_unchanged")),
    Fault("normalize_on_device=auto turns on without a GPU", "src/gputrain/data/device_normalize.py",
          (("        return cfg.trainer.accelerator != \"cpu\" and torch.cuda.is_available()",
            "        return cfg.trainer.accelerator != \"cpu\" or torch.cuda.is_available()"),),
          ("tests/unit/test_device_normalize.py::test_auto_keeps_the_usual_path_on_a_cpu",
           f"{UINT8}::test_auto_keeps_the_usual_path_on_a_cpu")),
    Fault("a COCO task built without a run folder writes its splits where it runs", "src/gputrain/tasks/detection.py",
          (('split_dir = Path(tempfile.mkdtemp(prefix="gputrain-coco-splits-"))', 'split_dir = Path("splits")'),),
          ("tests/unit/test_data_coco.py::test_a_coco_task_built_without_a_run_folder_writes_nothing_where_it_runs",)),
    Fault("the FLOPs counter takes the uint8 image a worker hands over", "src/gputrain/tools/bench/throughput.py",
          (('"data.normalize_on_device=false",\n', '\n'),),
          ("tests/e2e/test_throughput.py::test_flops_are_counted_on_the_float_image_and_nothing_is_written_where_the_command_runs",)),
    Fault("training images are normalized twice", "src/gputrain/tasks/classification.py",
          (("normalize=not normalize_on_device(cfg))", "normalize=True)"),),
          ("tests/unit/test_device_normalize.py::test_a_batch_normalized_on_the_device_equals_the_one_normalized_in_workers",)),
    # -- issue 31: uint8 batches for every task ------------------------------------------------------------
    Fault("segmentation images are normalized in the workers and again on the device", "src/gputrain/tasks/segmentation.py",
          (("normalize=not on_device))", "normalize=True))"),),
          (f"{UINT8}::test_segmentation_images_made_float_on_the_device_equal_the_workers_and_masks_are_unchanged",)),
    Fault("segmentation's uint8 images are scaled on the device but not normalized", "src/gputrain/tasks/segmentation.py",
          (("task.train_collate = PixelCollate(IMAGENET_MEAN, IMAGENET_STD)", "task.train_collate = PixelCollate()"),),
          (f"{UINT8}::test_training_with_uint8_batches_gives_the_weights_of_the_usual_run[ade20k-deeplabv3plus]",)),
    Fault("the device scales pixels as ToDtype does (x * (1/255)), not as the workers divide", "src/gputrain/data/device_normalize.py",
          (("        return to_unit_float\n", "        return lambda x: x.to(torch.float32).mul_(1.0 / 255)\n"),),
          (f"{UINT8}::test_detection_images_are_divided_by_255_on_the_device_as_in_the_workers",
           f"{UINT8}::test_the_autoencoders_one_uint8_batch_is_both_its_inputs_and_its_targets")),
    Fault("detection's uint8 images reach the model undivided", "src/gputrain/data/device_normalize.py",
          (("        return to_unit_float\n", "        return lambda x: x.to(torch.float32)\n"),),
          (f"{UINT8}::test_training_with_uint8_batches_gives_the_weights_of_the_usual_run[coco-maskrcnn]",)),
    Fault("the autoencoder's inputs and targets are made float twice", "src/gputrain/data/device_normalize.py",
          (("        if key not in self._made:", "        if True:"),),
          (f"{UINT8}::test_the_autoencoders_one_uint8_batch_is_both_its_inputs_and_its_targets",)),
    Fault("detection's workers still make their images float", "src/gputrain/tasks/detection.py",
          (("train=True, uint8=on_device)", "train=True, uint8=False)"),),
          (f"{UINT8}::test_detection_images_are_divided_by_255_on_the_device_as_in_the_workers",)),
    Fault("the autoencoder's uint8 batch never becomes a PixelBatch", "src/gputrain/data/device_normalize.py",
          (("        if alone:\n            return PixelBatch(batch, self.mean, self.std)\n", ""),),
          (f"{UINT8}::test_the_autoencoders_one_uint8_batch_is_both_its_inputs_and_its_targets",)),
    Fault("a task of your own ignores data.normalize_on_device=true silently", "src/gputrain/config/checks.py",
          (("if cfg.data.normalize_on_device is True and cfg.task not in UINT8_TASKS:", "if False:"),),
          (f"{UINT8}::test_a_task_of_your_own_refuses_true_in_one_line",)),
    Fault("segmentation averages its loss over the counted pixels of each micro-batch", "src/gputrain/tasks/segmentation.py",
          (("return (per_pixel.flatten(1).sum(1) / counted.clamp(min=1)).mean()",
            "return per_pixel.sum() / counted.sum()"),),
          ("tests/distributed/test_segmentation_parity.py",)),
    Fault("segmentation's evaluation loss divides by zero counted pixels", "src/gputrain/tasks/segmentation.py",
          (("return outputs, total / (targets != self.ignore_index).sum().clamp(min=1)",
            "return outputs, total / (targets != self.ignore_index).sum()"),),
          ("tests/distributed/test_segmentation_parity.py",)),
    # -- issue 16, seventh session --------------------------------------------------------------
    Fault("every launcher and rank imports the pipeline strategy (1.5 s of CPU each)", "src/gputrain/strategies/__init__.py",
          (("import importlib\n", "import importlib\n\nimport gputrain.strategies.pipeline  # noqa: F401\n"),),
          ("tests/unit/test_units.py::test_a_run_imports_no_optional_strategy_until_it_names_one",)),
    Fault('a strategy missing a torch feature is called unknown', 'src/gputrain/strategies/__init__.py',
          (('raise ValueError(f"trainer.strategy={name} needs {err.name}',
            'raise ValueError(f"trainer.strategy={name!r} is unknown; it needs {err.name}'), ),
          ("tests/unit/test_units.py::test_a_strategy_whose_torch_feature_is_missing_is_one_line_naming_the_module",)),
    Fault("precision mixed takes float16 on a GPU that has bfloat16", "src/gputrain/config/resolve.py",
          (('    if torch.cuda.is_bf16_supported(including_emulation=False):\n        return "bf16-mixed"\n',
            '    if torch.cuda.is_bf16_supported(including_emulation=False):\n        return "16-mixed" if name == "mixed" else "bf16-mixed"\n'),),
          ("tests/unit/test_fast_path.py::test_mixed_takes_bf16_where_the_gpu_has_it_and_float16_with_loss_scaling_where_not",)),
    Fault('auto and mixed take bfloat16 that a V100 only emulates', 'src/gputrain/config/resolve.py',
          (('is_bf16_supported(including_emulation=False)',
            'is_bf16_supported()'), ),
          ("tests/unit/test_fast_path.py::test_mixed_takes_bf16_where_the_gpu_has_it_and_float16_with_loss_scaling_where_not",)),
    # -- issue 16, eighth session ---------------------------------------------------------------
    Fault('the launcher imports torch (the strategy classes) before it starts the ranks', 'src/gputrain/launcher/spec.py',
          (('        nproc = processes_per_node(cfg.trainer.strategy, cfg.trainer.devices)',
            '        from gputrain.strategies import strategy_class\n\n        nproc = strategy_class(cfg.trainer.strategy).processes_per_node(cfg.trainer.devices)'), ),
          ("tests/e2e/test_faults.py::test_the_direct_launch_starts_ranks_before_torch_in_own_sessions_and_leaves_none_when_killed",)),
    Fault("the direct launcher keeps the ranks in its own session (a busy machine gives them one share)",
          "src/gputrain/launcher/direct.py",
          (("env=env, start_new_session=True,", "env=env,"),),
          ("tests/e2e/test_faults.py::test_the_direct_launch_starts_ranks_before_torch_in_own_sessions_and_leaves_none_when_killed",)),
    Fault("bf16-mixed by name runs on a GPU that only emulates bfloat16", "src/gputrain/precision.py",
          (("torch.cuda.is_bf16_supported(including_emulation=False)", "torch.cuda.is_bf16_supported()"),),
          ("tests/unit/test_units.py::test_bf16_mixed_by_name_is_refused_on_a_gpu_that_only_emulates_bfloat16",)),
    Fault("a rank that cannot start leaves the ranks already started running", "src/gputrain/launcher/direct.py",
          (("            self.close()\n            raise", "            raise"),),
          ("tests/distributed/test_launch.py::test_a_rank_that_cannot_start_leaves_none_of_the_others_running",)),
    Fault("the direct launcher does not forward a signal it receives to the ranks", "src/gputrain/launcher/direct.py",
          (("        self.signum = self.signum or signum\n        self.send(signum)",
            "        self.signum = self.signum or signum"),),
          ("tests/e2e/test_first_hour.py::test_3_an_interrupt_stops_cleanly_with_one_line[2-15-False-143]",)),
    # -- issue 16, eighth session: faults a planted-fault review found surviving ----------------------
    Fault('the resolved config keeps reuse_host_memory=auto', 'src/gputrain/config/resolve.py',
          (('cudnn_benchmark=fast.cudnn_benchmark, reuse_host_memory=fast.reuse_host_memory)',
            'cudnn_benchmark=fast.cudnn_benchmark)'), ),
          ("tests/unit/test_fast_path.py::test_the_resolved_config_replaces_every_auto_by_what_ran",)),
    Fault('the resolved config keeps optim.fused=auto', 'src/gputrain/config/resolve.py',
          (('optim=dataclasses.replace(o, fused=fast.fused_optimizer))',
            'optim=o)'), ),
          ("tests/unit/test_fast_path.py::test_the_resolved_config_replaces_every_auto_by_what_ran",)),
    Fault('cudnn.benchmark never switched on', 'src/gputrain/engine/fast.py',
          (('        torch.backends.cudnn.benchmark = True',
            '        pass'), ),
          ("tests/unit/test_fast_path.py::test_cudnn_benchmark_is_switched_on_by_the_run_and_never_off",)),
    Fault("reuse_host_memory=true accepted without glibc", "src/gputrain/config/resolve.py", (("    if t.reuse_host_memory is True and not glibc():", "    if False:"),), ("tests/unit/test_fast_path.py::test_reusing_host_memory_is_refused_where_the_c_library_is_not_glibc",)),
    Fault("bench throughput times the first epoch too", "src/gputrain/tools/bench/throughput.py", (("    values = [r[key] for r in (epochs[1:] or epochs) if r.get(key) is not None]", "    values = [r[key] for r in epochs if r.get(key) is not None]"),), ("tests/unit/test_fast_path.py::test_bench_throughput_times_the_epochs_after_the_first_and_a_single_epoch_as_it_is",)),
    Fault('the non-finite warning printed at every skipped save', 'src/gputrain/checkpoint/snapshot.py',
          (('            if not self._warned_not_finite:  # once',
            '            if True:  # once'), ),
          ("tests/unit/test_checkpoint_writer.py::test_a_non_finite_snapshot_is_skipped_with_one_warning_per_run",)),
    Fault("a writer error names no newest whole checkpoint", "src/gputrain/checkpoint/snapshot.py", (("            kept = self.store.latest_valid()", "            kept = None"),), ("tests/unit/test_checkpoint_writer.py::test_a_failed_background_save_names_the_newest_whole_checkpoint",)),
    Fault('async_checkpoint=false still writes in the background', 'src/gputrain/checkpoint/snapshot.py',
          (('        if not self.asynchronous:\n            if after is not None:',
            '        if False:\n            if after is not None:'), ),
          ("tests/unit/test_checkpoint_writer.py::test_a_synchronous_writer_writes_in_the_callers_thread_and_fails_at_the_save",)),
    Fault('check_plain left to the writer thread', 'src/gputrain/checkpoint/snapshot.py',
          (('        check_plain(state)\n        self._writing',
            '        self._writing'), ('            if after is not None:\n                after.result()  # the shards',
            '            check_plain(state)\n            if after is not None:\n                after.result()  # the shards'), ),
          ("tests/unit/test_checkpoint_writer.py::test_an_entry_a_resume_could_not_load_is_refused_at_the_save_in_the_callers_thread",)),
    Fault("a signal's stop names its checkpoint before it is on disk", 'src/gputrain/checkpoint/checkpointer.py',
          (('                if wait:\n                    self.writer.wait()',
            '                if False:\n                    self.writer.wait()'), ),
          ("tests/unit/test_checkpoint_writer.py::test_a_signal_stop_names_its_checkpoint_only_once_the_file_is_on_disk",)),
    Fault("a second Ctrl-C within two seconds aborts at once", "src/gputrain/dist/stop.py",
          (('        if self.received and signum == signal.SIGINT and now - self._first_at > 2.0:',
            '        if self.received and signum == signal.SIGINT:'),),
          ("tests/unit/test_signals.py::test_a_second_ctrl_c_within_two_seconds_is_absorbed_and_one_later_aborts",)),
    Fault("SIGUSR1 is not a stop signal", "src/gputrain/dist/stop.py",
          (('STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)',
            'STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)'),),
          ("tests/unit/test_signals.py::test_sigusr1_stops_a_run_at_a_step_boundary_with_exit_code_138",)),
    Fault("fit leaves its signal handlers installed", "src/gputrain/dist/stop.py",
          (('        for sig, handler in self._previous.items():\n            signal.signal(sig, handler)\n        self._previous.clear()',
            '        self._previous.clear()'),),
          ("tests/unit/test_signals.py::test_fit_puts_back_the_signal_handlers_it_found_after_success_and_after_failure",)),
    Fault("a signal's stop saves without the check on every rank", 'src/gputrain/checkpoint/checkpointer.py',
          (('        in_background = self.writer.asynchronous and not wait',
            '        in_background = self.writer.asynchronous'), ),
          ("tests/unit/test_promises.py::test_a_signals_stop_at_a_diverged_step_checks_before_writing_and_stops_there",)),
    Fault("model_weights unpickles with weights_only=False", "src/gputrain/checkpoint/load.py",
          (('    state = _load_safely(path, "cpu")\n    if isinstance(state, dict) and state.get("sharded"):',
            '    state = torch.load(path, map_location="cpu", weights_only=False)\n    if isinstance(state, dict) and state.get("sharded"):'),),
          ("tests/unit/test_checkpoint_store.py::test_malicious_pickle_is_refused_and_runs_nothing",)),
    Fault("every checkpoint load unpickles with weights_only=False", "src/gputrain/checkpoint/load.py",
          (("        return torch.load(path, map_location=map_location, weights_only=True)",
            "        return torch.load(path, map_location=map_location, weights_only=False)"),),
          ("tests/unit/test_checkpoint_store.py::test_malicious_pickle_is_refused_and_runs_nothing",)),
    Fault('num_workers=auto ignores the other processes of the node', 'src/gputrain/engine/setup.py',
          (('local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size))',
            'local_processes=1'), ),
          ("tests/unit/test_data_workers.py::test_a_trainer_divides_the_cores_by_the_processes_on_its_node",)),
    Fault('data.synthetic=true ignored by the training loader', 'src/gputrain/engine/setup.py',
          (('    if synthetic:\n        from gputrain.data.synthetic import DeviceResidentSamples',
            '    if False:\n        from gputrain.data.synthetic import DeviceResidentSamples'), ),
          ("tests/e2e/test_throughput.py::test_synthetic_training_serves_every_index_from_the_first_eight_real_samples",)),
    Fault("synthetic data keeps one sample instead of 8", "src/gputrain/data/synthetic.py",
          (('SYNTHETIC_SAMPLES = 8',
            'SYNTHETIC_SAMPLES = 1'),),
          ("tests/e2e/test_throughput.py::test_synthetic_training_serves_every_index_from_the_first_eight_real_samples",)),
    Fault("ranks of the direct launcher get no TORCHELASTIC_ERROR_FILE", "src/gputrain/launcher/direct.py",
          (('        "TORCHELASTIC_ERROR_FILE": error_file, "TORCH_NCCL_ASYNC_ERROR_HANDLING"',
            '        "TORCH_NCCL_ASYNC_ERROR_HANDLING"'),),
          ("tests/unit/test_direct_launch.py::test_each_rank_gets_every_variable_torchrun_sets",)),
    Fault("a failing rank's peers are never sent SIGTERM", "src/gputrain/launcher/direct.py",
          (("        failures = job.stop_all(terminate=terminate)", "        failures = job.stop_all(terminate=False)"),),
          ("tests/distributed/test_launch.py::test_when_a_rank_fails_the_launcher_stops_the_others_with_sigterm",)),
    Fault("a rank that left for the launcher's SIGTERM is reported instead of the one that failed",
          "src/gputrain/launcher/direct.py",
          (("        if terminate:  # a rank that left", "        if False:  # a rank that left"),),
          ("tests/distributed/test_launch.py::test_when_a_rank_fails_the_launcher_stops_the_others_with_sigterm",)),
    Fault('the launcher counts FSDP as one process', 'src/gputrain/strategies/__init__.py',
          (('"fsdp": Registered("gputrain.strategies.fsdp:FSDP")',
            '"fsdp": Registered("gputrain.strategies.fsdp:FSDP", one_process=True)'), ),
          ("tests/unit/test_units.py::test_the_launchers_process_count_is_each_strategys_own",)),
    Fault("the pipeline's refusal of 16-mixed does not say that mixed means it on older GPUs",
          "src/gputrain/config/checks.py",
          ((", which `mixed` also means \"\n                             \"on a GPU without bfloat16", ""),),
          ("tests/unit/test_model_parallel_placement.py::test_pipeline_refuses_settings_it_cannot_honour[16-mixed]",)),
    # -- issue 28 items 1-10, 12: what a new user lost (round 3) ---------------------------------------------------
    Fault("--overwrite clears a folder holding files gputrain did not write", "src/gputrain/runs/folder.py",
          (("    foreign = foreign_file(path)\n", "    foreign = None\n"),),
          ("tests/unit/test_run_folder.py::test_overwrite_refuses_a_run_folder_holding_one_file_gputrain_did_not_write",)),
    Fault("a folder with config.yaml and checkpoints/ counts as a run without the marker", "src/gputrain/runs/folder.py",
          (("    if not (path / RUN_MARKER).is_file() and not (path / CHECKPOINTS / MANIFEST).is_file():",
            "    if not (path / CHECKPOINTS).is_dir() and not (path / \"config.yaml\").is_file():"),),
          ("tests/unit/test_run_folder.py::test_a_folder_without_the_run_marker_or_a_manifest_is_not_a_run",)),
    Fault("a checkpoint file the manifest does not list counts as gputrain's", "src/gputrain/runs/folder.py",
          (("        if entry.is_file() and (entry.name == MANIFEST or entry.name in listed or TEMPORARY.match(entry.name)):",
            "        if entry.is_file() and (entry.suffix == \".pt\" or entry.name == MANIFEST or entry.name in listed\n"
            "                                or TEMPORARY.match(entry.name)):"),),
          ("tests/unit/test_run_folder.py::test_overwrite_refuses_a_run_folder_holding_one_file_gputrain_did_not_write",)),
    Fault("tools read a sharded checkpoint's empty model entry", "src/gputrain/checkpoint/load.py",
          (("    if gather_sharded and state.get(\"sharded\"):", "    if False:"),),
          ("tests/e2e/test_sharded_tools.py::test_eval_of_a_sharded_checkpoint_equals_the_runs_logged_val_loss",)),
    Fault('a resumed epoch starts its loss sums at 0', 'src/gputrain/engine/setup.py',
          (('    return state, resume.get("loss_window") or None',
            '    return state, None'), ),
          ("tests/unit/test_promises.py::test_a_resumed_epoch_logs_the_loss_and_samples_of_the_uninterrupted_run",)),
    Fault("the open loss window of a resumed epoch loses its first part", "src/gputrain/engine/state.py",
          (("        return total + self._open[0], n + self._open[1], skipped + self._open[2]",
            "        return total, n, skipped"),),
          ("tests/unit/test_promises.py::test_a_resumed_epoch_logs_the_loss_and_samples_of_the_uninterrupted_run",)),
    Fault("--resume auto into an empty folder says nothing", "src/gputrain/checkpoint/checkpointer.py",
          (("            if not found:  # a mistyped --out", "            if False:  # a mistyped --out"),),
          ("tests/unit/test_promises.py::test_resume_auto_into_a_folder_without_checkpoints_says_a_new_run_starts",)),
    Fault("the launcher leaves strategy options to the ranks", "src/gputrain/config/checks.py",
          (("        raise ValueError(\"trainer.overwrite=true would delete the run that trainer.resume=auto continues; choose one\")\n"
            "    check_split_options(cfg)",
            "        raise ValueError(\"trainer.overwrite=true would delete the run that trainer.resume=auto continues; choose one\")"),),
          ("tests/unit/test_model_parallel_placement.py::"
           "test_the_launcher_refuses_a_pipeline_its_ranks_would_refuse_before_any_starts",)),
    Fault("micro-batches of one sample under BatchNorm reach torch's error", "src/gputrain/strategies/stages.py",
          (("        if not norms or min(micro_batch_sizes(batch_size, m)) > 1:",
            "        if not norms or split_size(batch_size, m) > 1:"),),
          ("tests/unit/test_model_parallel_placement.py::"
           "test_micro_batches_of_one_sample_under_batchnorm_are_refused_before_training",)),
    Fault("bench throughput takes the upper middle value for the median", "src/gputrain/tools/bench/throughput.py",
          (("        return statistics.median(windows), len(windows)",
            "        return sorted(windows)[len(windows) // 2], len(windows)"),),
          ("tests/e2e/test_throughput.py::test_throughput_is_the_median_of_the_windows_after_the_first_epoch",)),
    Fault("bench throughput prints an input-bound ratio above 1 without a caution", "src/gputrain/tools/bench/throughput.py",
          (("    if result.input_bound_ratio > 1.0:", "    if result.input_bound_ratio > 100.0:"),),
          ("tests/e2e/test_throughput.py::test_impossible_or_rough_figures_come_with_a_caution_saying_why",)),
    Fault("the start-up line claims cuDNN's autotuner on a CPU", 'src/gputrain/config/resolve.py',
          (('cudnn_benchmark=cuda and _auto(t.cudnn_benchmark, facts.fixed_shapes),',
            'cudnn_benchmark=_auto(t.cudnn_benchmark, cuda and facts.fixed_shapes),'), ),
          ("tests/unit/test_fast_path.py::test_the_start_up_line_names_what_changes_the_run_and_only_what_is_on",)),
    Fault("the start-up line hides synthetic data", "src/gputrain/engine/record.py",
          (("    if d.synthetic:\n", "    if False:\n"),),
          ("tests/unit/test_fast_path.py::test_the_start_up_line_names_what_changes_the_run_and_only_what_is_on",)),
    Fault("a damaged checkpoint outside its run folder loads", "src/gputrain/checkpoint/load.py",
          (("    problem = check_against(path, entries) if entries else check_unlisted(path, legacy_ok=True)",
            "    problem = check_against(path, entries) if entries else None"),),
          ("tests/unit/test_checkpoint_store.py::test_a_damaged_copy_outside_its_run_folder_is_refused_by_its_own_crcs",)),
    Fault('config.yaml sends its recipe back into the old run folder', 'src/gputrain/engine/record.py',
          (('    where = dataclasses.replace(t, out="", resume="", overwrite=False)',
            '    where = t'), ),
          ("tests/e2e/test_first_hour.py::test_1_a_runs_config_yaml_trains_again_as_a_recipe_into_a_new_folder",)),
    Fault("a signal after the last epoch is swallowed", "src/gputrain/engine/trainer.py",
          (("                if self.stop.received and self.dist.is_main:  # after the last step",
            "                if False:  # after the last step"),),
          ("tests/unit/test_signals.py::test_a_signal_after_the_last_epoch_says_the_run_finished",)),
    Fault("one epoch's curves get fractional epoch ticks", "src/gputrain/runs/pictures.py",
          (("MaxNLocator(integer=True, min_n_ticks=1)", "MaxNLocator(integer=True)"),),
          ("tests/unit/test_report.py::test_the_epoch_axis_has_whole_epochs_only",)),
    Fault("the process group gputrain made is left to interpreter exit", "src/gputrain/dist/env.py",
          (("        atexit.register(_teardown_at_exit)\n", ""),),
          ("tests/e2e/test_user_code.py::"
           "test_a_finished_python_api_job_ends_its_process_group_before_interpreter_exit",)),
    Fault("torch modules that default to group.WORLD are imported after the group exists", "src/gputrain/dist/env.py",
          (("        _import_modules_that_capture_the_world_group()\n", ""),),
          ("tests/e2e/test_user_code.py::"
           "test_a_finished_python_api_job_ends_its_process_group_before_interpreter_exit",)),
    Fault("an FSDP mesh keeps its destroyed group alive", "src/gputrain/dist/env.py",
          (("        getattr(mesh, \"_pg_registry\", {}).clear()\n", "        pass\n"),),
          ("tests/e2e/test_user_code.py::"
           "test_a_finished_python_api_job_ends_its_process_group_before_interpreter_exit[fsdp]",)),
    Fault("a model in a reference cycle keeps its destroyed group to interpreter exit", "src/gputrain/dist/env.py",
          (("    gc.collect()\n", ""),),
          ("tests/e2e/test_user_code.py::"
           "test_a_finished_python_api_job_ends_its_process_group_before_interpreter_exit",)),
    # -- issue 28 item 11: planted-fault review of predict, pretrained, config checks, download, report, resume accounting, sampling
    Fault("[28.11] predict passes an image's size as (W, H)", "src/gputrain/tools/predict/run.py",
          (("self.preprocess(image), (int(image.shape[1]), int(image.shape[2]))",
            "self.preprocess(image), (int(image.shape[2]), int(image.shape[1]))"),),
          (f"{PREDICT}::test_masks_of_images_of_other_shapes_are_whole_image_predictions_in_rows_and_columns",)),
    Fault("[28.11] predict's repeated stems overwrite each other's outputs", "src/gputrain/tools/predict/run.py",
          (("        while stem in taken:", "        while False:"),),
          (f"{PREDICT}::test_output_names_stay_unique_where_a_numbered_stem_is_also_a_files_own",
           f"{PREDICT}::test_masks_of_images_of_other_shapes_are_whole_image_predictions_in_rows_and_columns")),
    Fault("[28.11] predict numbers a repeated stem without checking the name is free", "src/gputrain/tools/predict/run.py",
          (("        while stem in taken:", "        if stem in taken:"),),
          (f"{PREDICT}::test_output_names_stay_unique_where_a_numbered_stem_is_also_a_files_own",)),
    Fault("[28.11] predict stacks images of different shapes into one batch", "src/gputrain/tools/predict/run.py",
          (("    if len({tuple(im.shape) for im in images}) == 1:", "    if images:"),),
          (f"{PREDICT}::test_masks_of_images_of_other_shapes_are_whole_image_predictions_in_rows_and_columns",)),
    Fault("[28.11] predicted masks written transposed", "src/gputrain/tasks/segmentation.py",
          (("PngEncoder((labels.to(torch.int16) + 1).to(torch.uint8)[None]",
            "PngEncoder((labels.to(torch.int16) + 1).to(torch.uint8).t().contiguous()[None]"),),
          (f"{PREDICT}::test_masks_of_images_of_other_shapes_are_whole_image_predictions_in_rows_and_columns",)),
    Fault("[28.11] predict centre-crops segmentation inputs to data.image_size", "src/gputrain/tasks/segmentation.py",
          (("segmentation_transform(None if whole_image else (cfg.data.image_size or None), train=False)",
            "segmentation_transform(cfg.data.image_size or None, train=False)"),),
          (f"{PREDICT}::test_masks_of_images_of_other_shapes_are_whole_image_predictions_in_rows_and_columns",)),
    Fault("[28.11] smaller segmentation logits resized to (W, H)", "src/gputrain/tasks/segmentation.py",
          (('logits = F.interpolate(logits[None], size=size, mode="bilinear"',
            'logits = F.interpolate(logits[None], size=size[::-1], mode="bilinear"'),),
          (f"{TASKS}::test_segmentation_labels_of_smaller_logits_are_resized_to_the_image_rows_and_columns_in_place",)),
    Fault("[28.11] predictions.csv top-5 scores in increasing order", "src/gputrain/tasks/classification.py",
          (('" ".join(f"{s:.6f}" for s in scores)])', '" ".join(f"{s:.6f}" for s in sorted(scores))])'),),
          (f"{PREDICT}::test_classification_csv_lists_the_top_classes_by_name_with_their_probabilities",)),
    Fault('[28.11] predictions.csv names every top-5 class after the first', 'src/gputrain/tasks/classification.py',
          (('" ".join(name_of(self.class_names, k) for k in labels)',
            '" ".join(name_of(self.class_names, labels[0]) for k in labels)'), ),
          (f"{PREDICT}::test_classification_csv_lists_the_top_classes_by_name_with_their_probabilities",)),
    Fault("[28.11] predictions.json gives an ambiguous file name the first of its ids",
          "src/gputrain/tasks/detection.py",
          (("        if len(ids) == 1:", "        if ids:"),),
          (f"{PREDICT}::test_an_image_whose_name_the_annotation_file_holds_twice_gets_a_new_id",)),
    Fault("[28.11] predict numbers COCO categories in file order", "src/gputrain/tasks/detection.py",
          (("categories = sorted(coco.getCatIds())", "categories = list(coco.getCatIds())"),),
          ("tests/unit/test_data_coco.py::"
           "test_predict_maps_labels_to_the_categories_training_used_when_the_file_lists_them_out_of_id_order",)),
    Fault("[28.11] training numbers COCO categories in file order", "src/gputrain/data/coco.py",
          (("categories = sorted(self.coco.getCatIds())", "categories = list(self.coco.getCatIds())"),),
          ("tests/unit/test_data_coco.py::"
           "test_predict_maps_labels_to_the_categories_training_used_when_the_file_lists_them_out_of_id_order",)),
    Fault("[28.11] predict's labels one off the COCO categories", "src/gputrain/tasks/detection.py",
          (("label_to_category = {i + 1: c for i, c in enumerate(categories)}",
            "label_to_category = {i: c for i, c in enumerate(categories)}"),),
          ("tests/unit/test_data_coco.py::"
           "test_predict_maps_labels_to_the_categories_training_used_when_the_file_lists_them_out_of_id_order",)),
    Fault("[28.11] segmentation overlays paint class k in the colour of k + 1", "src/gputrain/tasks/draw.py",
          (("colors=[class_colour(k) for k in present])", "colors=[class_colour(k + 1) for k in present])"),),
          (f"{TASKS}::test_segmentation_overlay_paints_each_class_in_its_colour_and_leaves_other_values_clear",)),
    Fault("[28.11] detection overlays colour by model label, background included", "src/gputrain/tasks/draw.py",
          (("colours = [class_colour(int(k) - 1) for k in labels]", "colours = [class_colour(int(k)) for k in labels]"),),
          (f"{TASKS}::test_detections_scoring_at_least_one_half_are_drawn_in_their_class_colour",)),
    Fault("[28.11] a detection scoring exactly the threshold is not drawn", "src/gputrain/tasks/draw.py",
          (('keep = output["scores"].detach().cpu() >= threshold', 'keep = output["scores"].detach().cpu() > threshold'),),
          (f"{TASKS}::test_detections_scoring_at_least_one_half_are_drawn_in_their_class_colour",)),
    Fault("[28.11] the classification caption names the last of the top classes", "src/gputrain/tasks/classification.py",
          (('prob, label = output["scores"][0], output["labels"][0]',
            'prob, label = output["scores"][0], output["labels"][-1]'),),
          (f"{TASKS}::test_classification_caption_names_the_top_class_its_probability_and_the_truth",)),
    Fault("[28.11] a gputrain checkpoint as model.weights: its model entry not taken", "src/gputrain/models/pretrained.py",
          (('isinstance(state.get("model"), dict)', 'isinstance(state.get("state_dict"), dict)'),),
          ("tests/e2e/test_pretrained.py::test_a_gputrain_checkpoint_given_as_a_file_starts_from_its_model_with_a_new_head",)),
    Fault("[28.11] model.weights keeps DDP's module. prefix", "src/gputrain/models/pretrained.py",
          (('state = {prefix + k.removeprefix("module."): v for k, v in state.items()}',
            "state = {prefix + k: v for k, v in state.items()}"),),
          ("tests/e2e/test_pretrained.py::test_a_state_dict_saved_from_a_ddp_wrapped_model_loads_without_its_module_prefix",)),
    Fault("[28.11] frozen BatchNorm takes its bias from the weight", "src/gputrain/models/finetune.py",
          (("frozen.bias.copy_(child.bias.detach())", "frozen.bias.copy_(child.weight.detach())"),),
          ("tests/e2e/test_finetune.py::test_a_frozen_batchnorm_keeps_each_tensor_of_the_one_it_replaces_and_its_eval_outputs",)),
    Fault("[28.11] frozen BatchNorm built with the default eps", "src/gputrain/models/finetune.py",
          (("frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)", "frozen = FrozenBatchNorm2d(child.num_features)"),),
          ("tests/e2e/test_finetune.py::test_a_frozen_batchnorm_keeps_each_tensor_of_the_one_it_replaces_and_its_eval_outputs",)),
    Fault("[28.11] data.val_fraction=1 accepted (lt=1 -> le=1)", "src/gputrain/config/checks.py",
          (('"data.val_fraction": Range(ge=0, lt=1,', '"data.val_fraction": Range(ge=0, le=1,'),),
          (f"{RANGES}::test_each_documented_bound_refuses_the_value_just_outside_it_with_this_line",)),
    Fault("[28.11] optim.momentum=1 accepted (lt=1 -> le=1)", "src/gputrain/config/checks.py",
          (('"optim.momentum": Range(ge=0, lt=1)', '"optim.momentum": Range(ge=0, le=1)'),),
          (f"{RANGES}::test_each_documented_bound_refuses_the_value_just_outside_it_with_this_line",)),
    Fault("[28.11] trainer.keep_last=1 accepted", "src/gputrain/config/checks.py",
          (('"trainer.keep_last": Range(ge=2, le=10**6)', '"trainer.keep_last": Range(ge=1, le=10**6)'),),
          (f"{RANGES}::test_each_documented_bound_refuses_the_value_just_outside_it_with_this_line",)),
    Fault("[28.11] an exclusive lower bound shown with [", "src/gputrain/config/checks.py",
          (("""{'(' if self.gt is not None else '['}""", """{'[' if self.gt is not None else '('}"""),),
          (f"{RANGES}::test_each_documented_bound_refuses_the_value_just_outside_it_with_this_line",)),
    Fault("[28.11] seeds capped at 2^31 - 1", "src/gputrain/config/checks.py",
          (("SEED_MAX = 2**32 - 1", "SEED_MAX = 2**31 - 1"),),
          (f"{RANGES}::test_each_documented_bound_that_is_inclusive_is_taken",)),
    Fault("[28.11] launch.node_rank equal to launch.nnodes accepted", "src/gputrain/config/checks.py",
          (("if not launch.node_rank < launch.nnodes:", "if not launch.node_rank <= launch.nnodes:"),),
          (f"{RANGES}::test_node_rank_must_be_below_nnodes",)),
    Fault('[28.11] Trainer(...) checks number ranges but not the combinations the CLI refuses', 'src/gputrain/engine/trainer.py',
          (('        validate(self.cfg)  # the ranges',
            '        from gputrain.config.checks import check_numbers; check_numbers(self.cfg)  # the ranges'), ),
          (f"{RANGES}::test_the_trainer_refuses_the_combinations_the_command_line_refuses",)),
    Fault("[28.11] data.download_url ignored", "src/gputrain/data/download.py",
          (("return url or tv.url,", "return tv.url,"),),
          (f"{DOWNLOAD}::test_the_source_is_torchvisions_unless_a_mirror_and_its_md5_are_given",)),
    Fault("[28.11] a mirror's archive looked for under torchvision's file name", "src/gputrain/data/download.py",
          (("Path(url).name if url else tv.filename", "tv.filename"),),
          (f"{DOWNLOAD}::test_a_mirrors_archive_put_by_hand_under_its_own_name_is_checked_and_extracted_offline",)),
    Fault("[28.11] the default download checks no md5", "src/gputrain/data/download.py",
          (("md5 or tv.tgz_md5", "md5 or None"),),
          (f"{DOWNLOAD}::test_the_source_is_torchvisions_unless_a_mirror_and_its_md5_are_given",)),
    Fault("[28.11] read_metrics stops at a line cut by a crash", "src/gputrain/runs/pictures.py",
          (("            continue\n    return records", "            break\n    return records"),),
          (f"{REPORT}::test_a_line_cut_short_by_a_crash_is_skipped_and_the_resumed_records_after_it_are_read",)),
    Fault("[28.11] curves draw step records of an unfinished epoch", "src/gputrain/runs/pictures.py",
          (('        if "time/epoch_s" in r:', '        if "epoch" in r:'),),
          (f"{REPORT}::test_an_unfinished_epoch_and_a_non_finite_value_draw_no_point",)),
    Fault("[28.11] curves take a non-finite (null) value as a number", "src/gputrain/runs/pictures.py",
          (("if r.get(name) is not None]", "if name in r]"),),
          (f"{REPORT}::test_an_unfinished_epoch_and_a_non_finite_value_draw_no_point",)),
    Fault("[28.11] losses put on a log axis when they span less than 20x", "src/gputrain/runs/pictures.py",
          (("max(values) > 20 * min(values)", "max(values) < 20 * min(values)"),),
          (f"{REPORT}::test_losses_are_drawn_left_and_the_task_metric_right_and_a_spike_puts_the_losses_on_a_log_axis",)),
    Fault("[28.11] the metric panel draws the losses", "src/gputrain/runs/pictures.py",
          (("metrics = [n for n in curves if n not in LOSSES]", "metrics = [n for n in curves if n in LOSSES]"),),
          (f"{REPORT}::test_losses_are_drawn_left_and_the_task_metric_right_and_a_spike_puts_the_losses_on_a_log_axis",)),
    Fault("[28.11] a rank's sampler length counts its empty micro-batches", "src/gputrain/data/samplers.py",
          (("for micro in self.plan.micro_batches(k) if micro[self.dp_rank])",
            "for micro in self.plan.micro_batches(k))"),),
          (f"{UNITS}::test_an_accumulating_epoch_deals_these_samples_to_each_rank_and_a_short_last_step_leaves_rank_1_none",)),
    Fault("[28.11] training batches keyed to epoch 0 whatever the epoch", "src/gputrain/data/samplers.py",
          (("yield [(self.epoch, i) for i in micro[self.dp_rank]]", "yield [(0, i) for i in micro[self.dp_rank]]"),),
          (f"{UNITS}::test_an_accumulating_epoch_deals_these_samples_to_each_rank_and_a_short_last_step_leaves_rank_1_none",)),
    Fault("[28.11] a short last step counted as a whole global batch", "src/gputrain/data/samplers.py",
          (("return min(self.global_batch, self.num_samples - k * self.global_batch)", "return self.global_batch"),),
          (f"{UNITS}::test_an_accumulating_epoch_deals_these_samples_to_each_rank_and_a_short_last_step_leaves_rank_1_none",)),
    Fault("[28.11] every evaluation shard starts at sample 0", "src/gputrain/data/samplers.py",
          (("self.indices = eval_shard(length, rank, world_size)", "self.indices = eval_shard(length, 0, world_size)"),),
          (f"{UNITS}::test_the_evaluation_sampler_gives_each_rank_every_world_size_th_sample",)),
    Fault("[28.11] a seeded sample leaves the caller's generator moved", "src/gputrain/data/samplers.py",
          (("            torch.set_rng_state(saved)", "            pass"),),
          (f"{UNITS}::test_reading_a_seeded_sample_leaves_the_callers_generator_as_it_was",)),
    Fault("[28.11] seed and epoch alias in the epoch order", "src/gputrain/data/samplers.py",
          (("g.manual_seed(seed * 1_000_003 + epoch)", "g.manual_seed(seed + epoch)"),),
          (f"{UNITS}::test_no_two_seeds_share_an_epochs_order",)),
    Fault("[28.11] a resumed global batch ignores accumulation when checking divisibility", "src/gputrain/config/resolve.py",
          (("    if saved_global_batch % (dp_size * accumulate):", "    if saved_global_batch % dp_size:"),),
          (f"{UNITS}::test_a_resume_keeps_the_global_batch_counting_accumulation",)),
    Fault("[28.11] the resumed per-device batch ignores accumulation", "src/gputrain/config/resolve.py",
          (("    return saved_global_batch // (dp_size * accumulate)", "    return saved_global_batch // dp_size"),),
          (f"{UNITS}::test_a_resume_keeps_the_global_batch_counting_accumulation",)),
    Fault("[28.11] the process counts a refused resume suggests ignore accumulation", "src/gputrain/config/resolve.py",
          (("if saved_global_batch % (n * accumulate) == 0]", "if saved_global_batch % n == 0]"),),
          (f"{UNITS}::test_a_resume_keeps_the_global_batch_counting_accumulation",)),
    Fault("[28.11] the doctor calls waiting exactly one step's time input-bound", "src/gputrain/tools/diagnose/doctor_checks.py",
          (("    if wait <= INPUT_BOUND_RATIO * step:", "    if wait < INPUT_BOUND_RATIO * step:"),),
          ("tests/unit/test_doctor_checks.py::test_input_pipeline_verdicts_from_given_timings",)),
    Fault("[28.11] the doctor's worker count leaves out the model step", "src/gputrain/tools/diagnose/doctor_checks.py",
          (("load = wait if workers == 0 else workers * (wait + step)", "load = wait if workers == 0 else workers * wait"),),
          ("tests/unit/test_doctor_checks.py::test_input_pipeline_verdicts_from_given_timings",)),
    # -- issue 29: one shape for the whole house -----------------------------------------------------------------
    Fault("[29] a saved config's removed key stops an old checkpoint from loading", "src/gputrain/config/load.py",
          (("            out[section] = {k: v for k, v in out[section].items() if k != key}", "            pass"),),
          ("tests/e2e/test_old_runs.py::test_an_old_checkpoint_evaluates_to_the_metrics_its_version_printed",)),
    Fault("[29] a recipe that sets trainer.checkpoint_process is accepted in silence", "src/gputrain/config/load.py",
          (("isinstance(layer.get(section), dict) and key in layer[section]:",
            "isinstance(layer.get(section), dict) and key in layer[section] and False:"),),
          ("tests/unit/test_fast_path.py::test_a_bad_option_value_is_one_line_naming_the_field",)),
    Fault("[29] parity compares a split model's BatchNorm with one process's as if it saw whole batches",
          "src/gputrain/strategies/stages.py", (("    splits_batch = True\n", "    splits_batch = False\n"),),
          ("tests/e2e/test_cli_flags.py::test_parity_runs_one_mode_per_registered_strategy_with_the_strategys_own_shape",)),
    Fault("[29] a background save commits a file before the shards it names", "src/gputrain/checkpoint/snapshot.py",
          (("                after.result()  # the shards the file names", "                pass  # the shards the file names"),),
          ("tests/unit/test_checkpoint_writer.py::test_a_file_that_names_shards_is_committed_only_after_they_are_written",)),
    Fault("[29] a synchronous save commits a file before the shards it names", "src/gputrain/checkpoint/snapshot.py",
          (("            if after is not None:\n                after.result()\n",
            "            if after is not None:\n                pass\n"),),
          ("tests/unit/test_checkpoint_writer.py::test_a_file_that_names_shards_is_committed_only_after_they_are_written",)),
    Fault("[29] the folder of the sharded save in flight is pruned", "src/gputrain/checkpoint/sharded.py",
          (("    used = {keep}", "    used = set()"),),
          ("tests/distributed/test_sharded_resume.py::test_sharded_checkpoint_of_two_ranks_resumes_on_one_and_on_two",)),
    Fault("[29] sharded folders left behind by the last saves' rotation", "src/gputrain/checkpoint/checkpointer.py",
          (("            prune_sharded_folders(self.store.folder)\n", "            pass\n"),),
          ("tests/distributed/test_sharded_resume.py::test_sharded_checkpoint_of_two_ranks_resumes_on_one_and_on_two",)),
    Fault("[29] the rank runner hands the ranks multiprocessing's authentication key", "src/gputrain/launcher/direct.py",
          (('.items() if k != "authkey"}', ".items()}"),),
          ("tests/distributed/test_launch.py::test_two_real_processes_see_each_other",)),
    Fault("[29] the launcher's failure report imports torch before the ranks start", "src/gputrain/launcher/failures.py",
          (("from gputrain.errors import EXIT_DIVERGED", "import torch  # noqa: F401\nfrom gputrain.errors import EXIT_DIVERGED"),),
          ("tests/e2e/test_faults.py::test_the_direct_launch_starts_ranks_before_torch_in_own_sessions_and_leaves_none_when_killed",)),
    # -- issue 31: decoding on TorchCodec
    Fault("[31] the header-only size check ignores an EXIF quarter turn", "src/gputrain/data/images.py",
          (("turned = im.getexif().get(_EXIF_ORIENTATION) in _QUARTER_TURNS", "turned = False"),),
          ("tests/unit/test_decode_torchcodec.py::test_exif_orientation_is_applied_where_torchvision_ignored_it",)),
    Fault("[31] 16-bit PNGs are cut to 8 bits", "src/gputrain/data/images.py",
          (('decode_image(data, mode="RGB", output_dtype="auto")', 'decode_image(data, mode="RGB")'),),
          ("tests/unit/test_decode_torchcodec.py::test_hand_made_files_decode_to_the_pixels_torchvision_gave",)),
    # -- issue 31: the GPU checklist's verdicts (scripts/gpu_checklist.py)
    Fault("[31] the GPU checklist takes a NaN loss (written as null) for a finite one", "scripts/gpu_checklist.py",
          (("isinstance(v, (int, float)) and math.isfinite(v)", "v is None or math.isfinite(v)"),),
          (f"{CHECKLIST}::test_a_finished_run_passes_and_a_nan_loss_fails_the_checklist_naming_the_recipe",)),
    Fault("[31] the GPU checklist passes CUDA tests that were all skipped", "scripts/gpu_checklist.py",
          (('    if not outcomes["passed"]:', '    if False:'),),
          (f"{CHECKLIST}::test_the_cuda_tests_fail_when_one_fails_or_none_ran",)),
    # issue 30: the plan before the run
    Fault("[30] 1F1B planned as if it held every micro-batch (GPipe)", "src/gputrain/tools/plan/memory.py",
          (('activation_scale(stages, micro_batches, schedule)[stage]',
            'activation_scale(stages, micro_batches, "gpipe")[stage]'),),
          ("tests/e2e/test_plan.py::test_plan_lists_every_plan_for_two_devices_with_the_json_fields",)),
    Fault("[30] the fake step counts one sample fewer than the real one", "src/gputrain/tools/plan/memory.py",
          (("inputs, targets = fake(work.batch(batch_size))\n        return _counted_step",
            "inputs, targets = fake(work.batch(batch_size - 1))\n        return _counted_step"),),
          ("tests/e2e/test_plan.py::test_fake_step_equals_memtrackers_count_of_a_real_step",)),
    Fault("[30] --strategy auto with no fitting plan exits 0", "src/gputrain/tools/plan/command.py",
          (("        raise SystemExit(2)", "        raise SystemExit(0)"),),
          ("tests/e2e/test_plan.py::test_auto_with_a_budget_no_plan_fits_is_one_line_before_any_worker",)),
    Fault("[30] an unwritable --json found only after planning", "src/gputrain/tools/plan/command.py",
          (("            Path(json_path).parent.mkdir(parents=True, exist_ok=True)\n        except",
            "            pass\n        except"),),
          ("tests/e2e/test_plan.py::test_a_json_path_that_cannot_be_written_is_one_line_before_planning",)),
    Fault("[30] a plan chosen without the margin", "src/gputrain/tools/plan/plans.py",
          (("fitting = [p for p in plans if p.fits_with_margin]", "fitting = [p for p in plans if p.fits]"),),
          ("tests/e2e/test_plan.py::test_the_choice_keeps_the_margin_and_prefers_the_fastest",)),
    Fault("[30] --strategy auto trains the recipe's batch per process, not the planned one", "src/gputrain/tools/plan/plans.py",
          (('f"trainer.batch_size={self.batch_size}",', 'f"trainer.batch_size={self.global_batch}",'),),
          ("tests/e2e/test_plan.py::test_the_choice_keeps_the_margin_and_prefers_the_fastest",)),
    Fault("[30] DDP planned with a second gradient copy beside its buckets", "src/gputrain/tools/plan/plans.py",
          (("memory.step_memory(self.work, b, held_gradients=True))",
            "memory.step_memory(self.work, b, held_gradients=True)).plus(other=buckets)"),),
          ("tests/e2e/test_plan_measured.py::test_each_ranks_measured_memory_is_within_10_percent_of_the_plan",)),
    Fault("[30] memory.json gives every rank rank 0's measure", "src/gputrain/engine/callbacks/memory.py",
          (("ranks = comm.all_gather_objects(self.measured)",
            "ranks = [dict(self.measured or {}, rank=r) for r in range(ctx.dist.world_size)]"),),
          ("tests/e2e/test_plan_measured.py::test_each_ranks_measured_memory_is_within_10_percent_of_the_plan",)),
    Fault("[30] a step's detached loss keeps the unreduced storage of an MSE loss", "src/gputrain/strategies/base.py",
          (("        return loss.detach().clone()", "        return loss.detach()"),),
          ("tests/e2e/test_plan_measured.py::test_one_devices_run_measures_what_the_plan_counts",)),
    Fault("[30] the model's outputs held through the backward", "src/gputrain/strategies/base.py",
          (("                del outputs\n", "                kept = outputs  # noqa: F841\n"),),
          ("tests/e2e/test_plan_measured.py::test_one_devices_run_measures_what_the_plan_counts",)),
    Fault("[30] doctor never warns about a prediction", "src/gputrain/tools/diagnose/plan_check.py",
          (("if abs(x) > TOLERANCE and gap]", "if abs(x) > 10 * TOLERANCE and gap]"),),
          ("tests/e2e/test_plan_measured.py::test_a_prediction_more_than_15_percent_off_is_a_warning",)),
    Fault("[30] a layer that fails on fake tensors is not named", "src/gputrain/tools/plan/memory.py",
          (('layer = f"layer {running[-1]} " if running else ""', 'layer = ""'),),
          ("tests/e2e/test_plan.py::test_a_layer_that_cannot_run_on_fake_tensors_is_named_and_the_step_measured",)),
    Fault("[30] a pipeline stage planned without the batch and its receive buffers", "src/gputrain/tools/plan/memory.py",
          (("buffers = [*tensors_of((inputs, targets)), *(tensors_of(received) if stage else []), *sent]",
            "buffers: list[torch.Tensor] = []"),),
          ("tests/e2e/test_plan_measured.py::test_a_small_models_pipeline_stages_count_the_batch_and_the_buffers_around_them",)),
    Fault("[30] activation checkpointing updates BatchNorm's statistics again in the recompute",
          "src/gputrain/parallel/activation_checkpoint.py",
          (("        m.momentum = 0.0\n", "        pass\n"),),
          ("tests/distributed/test_activation_checkpointing.py::test_one_process_trains_the_same_weights_and_buffers_with_and_without",)),
    Fault("[30] activation checkpointing counts the recomputed batches", "src/gputrain/parallel/activation_checkpoint.py",
          (("                m.num_batches_tracked.copy_(count)\n", "                pass\n"),),
          ("tests/distributed/test_activation_checkpointing.py::test_one_process_trains_the_same_weights_and_buffers_with_and_without",)),
    Fault("[30] activation checkpointing on the wrapper a chain hands, not the model's module",
          "src/gputrain/parallel/activation_checkpoint.py",
          (("for module in [block] if id(block) in owned else [m for m in block.children() if id(m) in owned]:",
            "for module in [block]:"),),
          ("tests/distributed/test_activation_checkpointing.py::test_a_chain_that_wraps_the_models_modules_checkpoints_the_modules_themselves",)),
    Fault("[30] a plan's global batch counts devices, not processes (model_parallel's batch doubled)",
          "src/gputrain/tools/plan/command.py",
          (("    processes = processes_per_node(t.strategy, devices) * nnodes", "    processes = devices * nnodes"),),
          ("tests/e2e/test_plan.py::test_the_planned_global_batch_is_the_one_the_recipe_trains_on_those_devices",)),
    Fault("[30] DDP's held-gradient count shared with the plain step's", "src/gputrain/tools/plan/memory.py",
          (('_once(work, ("step", batch_size, held_gradients),', '_once(work, ("step", batch_size),'),),
          ("tests/e2e/test_plan.py::test_fake_step_equals_memtrackers_count_of_a_real_step",)),
    Fault("[30] the optimizer's state never made before the counted step", "src/gputrain/tools/plan/memory.py",
          (("        p.grad = torch.zeros_like(p)\n    optimizer.step()\n",
            "        p.grad = torch.zeros_like(p)\n"),),
          ("tests/e2e/test_plan.py::test_fake_step_equals_memtrackers_count_of_a_real_step",)),
    Fault("[30] the peak-only tracker keeps the first snapshot, not the peak's", "src/gputrain/engine/callbacks/memory.py",
          (("                tracker._peak_mem_snap[device] = dict(snapshot)",
            "                tracker._peak_mem_snap.setdefault(device, dict(snapshot))"),),
          ("tests/e2e/test_plan.py::test_the_peak_only_tracker_keeps_the_peak_memtracker_gives",)),
    Fault("[30] pipeline +ac plans counted on the plain model", "src/gputrain/tools/plan/command.py",
          (("dataclasses.replace(_predict(ac, x, split), activation_checkpointing=True)",
            "dataclasses.replace(_predict(ac if not x.startswith('pipeline') else planner, x, split), "
            "activation_checkpointing=True)"),),
          ("tests/e2e/test_plan_measured.py::test_activation_checkpointing_plans_keep_fewer_activations_and_fit_larger_batches",)),
    Fault("[30] the first pipeline stage's input (the batch) given a gradient in the plan", "src/gputrain/tools/plan/memory.py",
          (("t.is_floating_point() and stage > 0)", "t.is_floating_point())"),),
          ("tests/e2e/test_plan_measured.py::test_a_small_models_pipeline_stages_count_the_batch_and_the_buffers_around_them",)),
    Fault("[30] the largest batch from the line through two peaks (the peak moves with the batch)",
          "src/gputrain/tools/plan/memory.py",
          (("    if low.moments and high.moments:\n", "    if False:\n"),),
          ("tests/e2e/test_plan.py::test_the_largest_batch_predicted_from_two_counts_is_what_a_count_at_it_gives",)),
    Fault("[30] --strategy auto counts no checkpointed plan for its choice", "src/gputrain/tools/plan/command.py",
          (("        checkpointed = [p.label for p in plans if p is not None and p.label in checkpointed and not p.fits_with_margin",
            "        checkpointed = [p.label for p in plans if False and p.label in checkpointed and not p.fits_with_margin"),),
          ("tests/e2e/test_plan.py::test_auto_chooses_what_the_whole_plan_chooses_with_less_counting",)),
    # -- issue 31: a step the float16 loss scaler skips is not a diverged run ------------------------------------
    Fault("[31] a skipped step leaves the forward's BatchNorm statistics (NaN after an overflow)", "src/gputrain/precision.py",
          (("        if not stepped:\n            self._before_step.restore()", "        if False:\n            pass"),),
          (f"{F16}::test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was",)),
    Fault("[31] the buffers saved before each micro-batch, not before the step", "src/gputrain/engine/epoch.py",
          (("        loop.precision.begin_step(module)\n        for m, shares in enumerate(micro_batches):\n",
            "        for m, shares in enumerate(micro_batches):\n            loop.precision.begin_step(module)\n"),),
          (f"{F16}::test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was",)),
    Fault("[31] a replaced buffer restored into the tensor it replaced", "src/gputrain/precision.py",
          (("        if self._same(buffers):\n            torch._foreach_copy_(buffers, self.saved)",
            "        if True:\n            torch._foreach_copy_(self.sources, self.saved)"),),
          (f"{F16}::test_a_buffer_the_forward_replaces_is_restored_after_a_skipped_step",)),
    Fault("[31] a skipped step's loss kept in the logged loss", "src/gputrain/engine/state.py",
          (("        if stepped:\n            self.loss_sum.add_(self._step_sum)",
            "        if True:\n            self.loss_sum.add_(self._step_sum)"),),
          (f"{F16}::test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was",)),
    Fault("[31] skipped samples counted in the epoch loss's mean", "src/gputrain/engine/state.py",
          (("        counted = self.epoch_samples - self.epoch_skipped\n", "        counted = self.epoch_samples\n"),),
          (f"{F16}::test_a_skipped_step_is_left_out_of_the_logged_loss_not_averaged_in",)),
    Fault("[31] skipped samples counted in a logged window's mean", "src/gputrain/engine/state.py",
          (('        return total / (n - skipped) if n > skipped else float("nan")',
            '        return total / n if n > skipped else float("nan")'),),
          (f"{F16}::test_a_window_mixing_trained_and_skipped_steps_logs_the_mean_of_the_trained_ones",)),
    Fault("[31] a window with any skipped step logs no loss", "src/gputrain/engine/epoch.py",
          (("            if window.flushed_counted > 0:", "            if window.flushed_counted == window.flushed_samples:"),),
          (f"{F16}::test_a_window_mixing_trained_and_skipped_steps_logs_the_mean_of_the_trained_ones",)),
    Fault("[31] a skipped step's samples left out of images/s", "src/gputrain/engine/state.py",
          (("        self.flushed_samples = n - self._open[1]", "        self.flushed_samples = n - skipped - self._open[1]"),),
          (f"{F16}::test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was",)),
    Fault("[31] an epoch whose every step was skipped reports a NaN loss", "src/gputrain/engine/epoch.py",
          (('        del metrics["train/loss"]', "        pass"),),
          (f"{F16}::test_an_epoch_whose_every_step_was_skipped_logs_no_loss_and_the_run_goes_on",)),
    Fault("[31] an epoch whose every step was skipped taken as diverged", "src/gputrain/engine/epoch.py",
          (("not math.isfinite(epoch_loss) and window.epoch_skipped < window.epoch_samples or",
            "not math.isfinite(epoch_loss) or"),),
          (f"{F16}::test_an_epoch_whose_every_step_was_skipped_logs_no_loss_and_the_run_goes_on",)),
    Fault("[31] the epoch's skipped samples not reported", "src/gputrain/engine/epoch.py",
          (("    if window.epoch_skipped:\n", "    if False:\n"),),
          (f"{F16}::test_a_forward_that_overflows_float16_is_skipped_and_leaves_the_model_as_it_was",)),
    Fault("[31] no limit on skipped steps in a row (a float16 overflow trains on, skipping every step)",
          "src/gputrain/engine/state.py",
          (("        if self.in_a_row < self.LIMIT:", "        if True:"),),
          (f"{F16}::test_a_forward_that_always_overflows_ends_the_run_in_one_line_naming_the_cause",)),
    Fault("[31] parity fails modes whose loss scaler skipped the same steps (NaN against NaN)",
          "src/gputrain/tools/diagnose/parity_compare.py",
          (("    row.loss_diffs = [0.0 if math.isnan(a) and math.isnan(b) else abs(a - b)",
            "    row.loss_diffs = [abs(a - b)"),),
          ("tests/distributed/test_parity_tool.py::test_parity_at_16_mixed_passes_modes_whose_loss_scaler_skipped_the_same_steps",)),
    Fault("[31] a resumed window's loss decided on the steps after the resume alone", "src/gputrain/engine/state.py",
          (("        self.flushed_counted = n - skipped\n",
            "        self.flushed_counted = n - skipped - self._open[1] + self._open[2]\n"),),
          (f"{F16}::test_a_window_resumed_mid_way_logs_its_loss_even_if_every_step_after_the_resume_was_skipped",)),
    Fault("[31] skipped steps counted in all, not in a row", "src/gputrain/engine/state.py",
          (("            self.in_a_row = self.loss_overflows_in_a_row = 0", "            self.loss_overflows_in_a_row = 0"),),
          (f"{F16}::test_only_25_skipped_steps_in_a_row_end_a_run_not_25_in_all",)),
    Fault("fit returns with its loaders' workers alive (gc stalls the caller 5 s a worker later)",
          "src/gputrain/engine/trainer.py",
          (("                setup.end_workers(self.loop.train_loader, self.loop.val_loader)", "                pass"),),
          ("tests/unit/test_data_workers.py::test_fit_evaluate_and_validate_end_their_loaders_workers_before_returning",)),
    Fault("evaluate() after fit returns with its workers alive", "src/gputrain/engine/trainer.py",
          (("            setup.end_workers(loop.val_loader)  # fit keeps", "            pass  # fit keeps"),),
          ("tests/unit/test_data_workers.py::test_fit_evaluate_and_validate_end_their_loaders_workers_before_returning",)),
    Fault("validate() returns with its workers alive", "src/gputrain/engine/trainer.py",
          (("        finally:\n            setup.end_workers(loop.val_loader)\n", "        finally:\n            pass\n"),),
          ("tests/unit/test_data_workers.py::test_fit_evaluate_and_validate_end_their_loaders_workers_before_returning",)),
    Fault("a plan command shown on two pages runs on neither", "tests/e2e/test_documented_commands.py",
          (("    return first.where if first.where.split(\":\")[0] != command.where.split(\":\")[0] else \"\"",
            "    return first.where"),),
          ("tests/e2e/test_documented_commands.py::test_the_pages_show_commands_and_the_skips_are_few",)),
)


def check_patterns(faults: tuple[Fault, ...]) -> list[str]:
    """One line per replacement whose text does not occur exactly once in its file (the list rotted)."""
    problems = []
    for fault in faults:
        path = ROOT / fault.file
        if not path.is_file():
            problems.append(f"{fault.name}: {fault.file} does not exist")
            continue
        text = path.read_text()
        for old, _ in fault.replacements:
            count = text.count(old)
            if count != 1:
                problems.append(f"{fault.name}: {old!r} occurs {count} times in {fault.file} (expected once); "
                                "update the pattern so it plants the same fault in the current code")
    return problems


def make_copy(parent: Path) -> Path:
    """``src/``, ``tests/``, ``scripts/`` (the GPU checklist's verdicts), ``pyproject.toml`` (pytest's options) and
    the pages the documented-commands test reads."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache")
    shutil.copytree(ROOT / "src", parent / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", parent / "tests", ignore=ignore)
    shutil.copytree(ROOT / "scripts", parent / "scripts", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", parent / "pyproject.toml")
    shutil.copytree(ROOT / "docs", parent / "docs")  # the pages the documented-commands test reads
    shutil.copy2(ROOT / "README.md", parent / "README.md")
    return parent


def plant(copy: Path, fault: Fault) -> None:
    path = copy / fault.file
    text = path.read_text()
    for old, new in fault.replacements:
        text = text.replace(old, new, 1)
    path.write_text(text)


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", re.MULTILINE)


def run_tests(copy: Path, tests: tuple[str, ...], timeout_s: float) -> tuple[str, str, float, str]:
    """Run ``tests`` in ``copy``: (outcome, first failing test and why, seconds, output).

    The outcome is ``passed``, ``failed``, ``timeout`` or an error of pytest itself (no test ran).
    """
    env = os.environ | {"PYTHONPATH": str(copy / "src"), "COLUMNS": "300", "OMP_NUM_THREADS": "1",
                        "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--tb=line", "-rfE",
           "-W", "ignore::UserWarning", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return "timeout", "", time.perf_counter() - start, out
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return "passed", "", seconds, output
    match = _FAILED.search(output)
    if proc.returncode in (1, 2) and match:  # 1: a test failed; 2: interrupted by -x after an error
        why = (match.group(3) or "").strip()
        return "failed", match.group(2) + (f" - {why[:150]}" if why else ""), seconds, output
    return f"error (pytest exit {proc.returncode})", "", seconds, output


def short(node: str) -> str:
    return node.removeprefix("tests/").replace(".py::", "::")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="match", default="", help="only faults whose name contains this text")
    parser.add_argument("--list", action="store_true", help="list the faults and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per fault before it counts as failed")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the chosen tests without faults")
    args = parser.parse_args(argv)
    faults = tuple(f for f in FAULTS if args.match.lower() in f.name.lower())
    if not faults:
        print(f"mutants: no fault name contains {args.match!r}", file=sys.stderr)
        return 2
    if args.list:
        for f in faults:
            print(f"{f.name}\n    {f.file}\n    " + "\n    ".join(short(t) for t in f.tests))
        return 0
    problems = check_patterns(faults)
    if problems:
        print("mutants: the fault list no longer matches the source:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    total = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gputrain-mutants-") as tmp:
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for f in faults for t in f.tests))
            outcome, failed, seconds, output = run_tests(make_copy(Path(tmp) / "baseline"), tests, args.timeout * 2)
            print(f"baseline (no fault, {len(tests)} test selections): {outcome} in {seconds:.0f} s", flush=True)
            if outcome != "passed":
                print(output[-3000:], file=sys.stderr)
                print(f"mutants: the chosen tests fail without any fault ({short(failed) or outcome}); fix that first",
                      file=sys.stderr)
                return 1
        rows, survived = [], []
        for i, fault in enumerate(faults):
            copy = make_copy(Path(tmp) / f"fault{i:02d}")
            plant(copy, fault)
            outcome, failed, seconds, output = run_tests(copy, fault.tests, args.timeout)
            caught = outcome == "failed"
            rows.append((fault.name, short(failed.split(" - ")[0]) if caught else outcome.upper(), seconds))
            print(f"{'caught ' if caught else 'SURVIVED'} {fault.name}: {short(failed) or outcome} ({seconds:.0f} s)",
                  flush=True)
            if not caught:
                survived.append(fault.name)
                print(output[-2000:], file=sys.stderr)
            shutil.rmtree(copy, ignore_errors=True)
    width = max(len(r[0]) for r in rows)
    test_width = max(len(r[1]) for r in rows)
    print(f"\n{'fault':<{width}}  {'caught by (first failing test)':<{test_width}}  seconds")
    for name, test, seconds in rows:
        print(f"{name:<{width}}  {test:<{test_width}}  {seconds:7.1f}")
    print(f"\n{len(rows) - len(survived)} of {len(rows)} faults caught in {time.perf_counter() - total:.0f} s")
    if survived:
        print("survived: " + "; ".join(survived), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
