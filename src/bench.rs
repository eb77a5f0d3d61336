//! `tally bench`.

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {}

pub async fn run(_config: crate::config::Config, _args: BenchArgs) -> anyhow::Result<()> {
    anyhow::bail!("not yet")
}
