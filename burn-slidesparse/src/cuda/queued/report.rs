//! Reports of the lanes (feature `internals`, for benchmarks and tests): how each lane's GEMM
//! calls ran and what its captured graphs hold.

use super::lanes::Lanes;

/// How a lane's GEMM calls ran: the ways differ by an order of magnitude in host time at
/// decode (a queued replay costs the caller ~3 us, a blocking call ~15-25 us), so a model
/// that is slower than its layers predict shows which way its calls took here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Replays of a captured graph queued on cubecl's device thread without waiting.
    pub queued: usize,
    /// Calls the caller waited for on cubecl's device thread, with a graph key (a replay
    /// while graphs are blocking, or the call that captures a graph).
    pub blocking_keyed: usize,
    /// Calls the caller waited for without a graph key (graphs off, or buffers not kept:
    /// a prompt-sized forward).
    pub blocking_unkeyed: usize,
    /// Calls ordered by host synchronization (`SyncMode::Host`).
    pub host_synced: usize,
}

impl std::ops::AddAssign for CallCounts {
    fn add_assign(&mut self, other: Self) {
        self.queued += other.queued;
        self.blocking_keyed += other.blocking_keyed;
        self.blocking_unkeyed += other.blocking_unkeyed;
        self.host_synced += other.host_synced;
    }
}

/// What a device's lanes hold of captured GEMM graphs, and how their GEMM calls ran: failed
/// captures (those calls run directly, through a host round trip, until the next table
/// clear retries them), a table that keeps filling up (recaptures), and calls that never
/// use graphs (graphs off, buffers not kept) show here.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphReport {
    /// Lanes (cubecl streams that ran work of ours on the device) in use.
    pub lanes: usize,
    /// Lanes retired with the threads that made them (their calls are in `calls`).
    pub retired: usize,
    /// Calls with a captured graph.
    pub captured: usize,
    /// The nodes of those graphs, summed.
    pub nodes: usize,
    /// Calls whose capture failed (run directly).
    pub failed: usize,
    /// Times a lane's table filled up and dropped every graph.
    pub clears: usize,
    /// Why a capture failed on some lane, if one did.
    pub last_failure: Option<String>,
    /// How the GEMM calls of every lane ran, summed.
    pub calls: CallCounts,
    /// Why some lane's work falls back to host synchronization (burn's stream not found),
    /// if one does.
    pub host_reason: Option<String>,
}

impl std::fmt::Display for GraphReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} lanes ({} more retired with their threads), {} graphs captured ({} nodes), {} \
             captures failed, {} table clears; GEMM calls: {} queued, {} blocking with a graph \
             key, {} blocking without, {} host-synchronized",
            self.lanes,
            self.retired,
            self.captured,
            self.nodes,
            self.failed,
            self.clears,
            self.calls.queued,
            self.calls.blocking_keyed,
            self.calls.blocking_unkeyed,
            self.calls.host_synced
        )?;
        if let Some(why) = &self.last_failure {
            write!(f, " (last failure: {why})")?;
        }
        if let Some(why) = &self.host_reason {
            write!(f, " (host-synchronized because {why})")?;
        }
        Ok(())
    }
}

impl Lanes {
    /// The GEMM graphs of every lane, summed (for reports).
    pub fn graph_report(&self) -> GraphReport {
        let mut report = GraphReport {
            lanes: self.lanes.len(),
            retired: self.retired_count,
            calls: self.retired_calls,
            ..GraphReport::default()
        };
        for lane in self.lanes.values() {
            let graphs = &lane.graphs;
            report.calls += lane.calls;
            report.captured += graphs.captured();
            report.failed += graphs.failed();
            report.clears += graphs.clears();
            report.nodes += graphs.nodes();
            if let Some(why) = graphs.last_failure() {
                report.last_failure = Some(why.to_string());
            }
            if let Some(Err(why)) = &lane.burn_stream {
                report.host_reason = Some(why.clone());
            }
        }
        report
    }
}
