// The start page: a token bound to an org goes straight to that org; any other sees the
// sections and a form to open an org or a container by id.

import { address, h, link, section } from '../dom.js';

export async function render({ view, principal, navigate }) {
  if (principal.org_id) {
    navigate(`/console/orgs/${encodeURIComponent(principal.org_id)}`, { replace: true });
    return;
  }
  const orgInput = h('input', { id: 'open-org', name: 'org_id', required: true, autocomplete: 'off' });
  const orgForm = h(
    'form',
    { id: 'open-org-form', class: 'inline' },
    h('label', { for: 'open-org' }, 'Org id'),
    orgInput,
    h('button', { type: 'submit' }, 'Open org'),
  );
  orgForm.addEventListener('submit', (event) => {
    event.preventDefault();
    navigate(`/console/orgs/${encodeURIComponent(orgInput.value.trim())}`);
  });
  const containerInput = h('input', { id: 'open-container', name: 'container_id', required: true, autocomplete: 'off' });
  const containerOrg = h('input', { id: 'open-container-org', name: 'org_id', autocomplete: 'off' });
  const containerForm = h(
    'form',
    { id: 'open-container-form', class: 'inline' },
    h('label', { for: 'open-container' }, 'Container id'),
    containerInput,
    h('label', { for: 'open-container-org' }, 'Org id (if several orgs used it)'),
    containerOrg,
    h('button', { type: 'submit' }, 'Open container'),
  );
  containerForm.addEventListener('submit', (event) => {
    event.preventDefault();
    const path = `/console/containers/${encodeURIComponent(containerInput.value.trim())}`;
    navigate(address(path, { org_id: containerOrg.value.trim() }));
  });
  view.append(
    h('h1', {}, 'tally console'),
    section('Open', orgForm, containerForm),
    section(
      'Sections',
      h(
        'ul',
        { class: 'links' },
        h('li', {}, link('/console/reconciliations', 'Reconciliations'), ': provider reports against the ledger'),
        h('li', {}, link('/console/periods', 'Periods'), ': closes, snapshots and the usage export'),
        h('li', {}, link('/console/audit', 'Audit'), ': the ledger, event by event'),
        h('li', {}, link('/console/operator', 'Operator'), ': ledger head, projection and relay lag, verification'),
      ),
    ),
  );
}
